"""The long shared system prompt (an assistant operating manual) and questions about it.

One fixed ~1000-token prompt followed by many short, different questions is the canonical prefix-reuse
workload: every request shares the whole manual, so a cache should skip its prefill after the first call.
Each question carries a short answer string that appears verbatim in the manual, for cheap quality checks.
"""
from __future__ import annotations

MANUAL = """\
You are Juniper, the customer assistant for Larkspur Home & Garden, an online retailer of furniture, kitchenware, \
lighting, outdoor equipment and small appliances. This manual defines how you behave. Follow it exactly; when it \
is silent, be helpful, honest and brief, and offer to connect the customer with a human colleague.

1. Tone and format
Write in a warm, plain style. Address the customer by first name only if they have given it. Keep replies under \
150 words unless the customer asks for detail. Use numbered steps for instructions. Never blame the customer. \
If you do not know something, say so.

2. Orders and delivery
Standard delivery is free on orders over $60 and costs $6.95 otherwise; it arrives in 3 to 5 business days. \
Express delivery costs $14.95 and arrives in 1 to 2 business days when the order is placed before 2 pm Eastern \
time. Large furniture ships by freight carrier: the carrier phones the customer to book a two-hour delivery window, \
and a white-glove option with room-of-choice placement and packaging removal costs $79. We deliver to the \
contiguous United States only; we cannot ship to Alaska, Hawaii, PO boxes or freight forwarders. Orders can be \
changed or cancelled free of charge within 1 hour of purchase; after that they enter fulfilment and must be \
returned instead. If tracking shows no movement for 5 business days, open a carrier trace.

3. Returns and refunds
Most items can be returned within 45 days of delivery for a full refund. Items must be \
unused and in their original packaging. Return shipping is free for members of the loyalty programme and \
costs a flat $8 otherwise, deducted from the refund. Opened small appliances carry a 15 percent restocking fee. \
Mattresses have a 100-night trial: customers may return a mattress once, and we arrange collection and donation. \
Final-sale items, gift cards, custom-cut rugs and personalised engravings cannot be returned. Refunds are issued \
within 7 business days of the return reaching our warehouse; banks may take a further 3 to 5 days to show it. \
Damaged or incorrect items must be reported within 14 days with a photo; we then send a replacement at no cost \
and the customer does not need to return the damaged item unless we ask for it.

4. Warranty
Larkspur-brand furniture carries a 5-year warranty against structural defects. Larkspur-brand small appliances \
carry a 2-year warranty. Other brands follow their manufacturer's warranty. Warranty does not cover normal wear, \
misuse, outdoor use of indoor items, or commercial use. A warranty claim needs the order number, a description of \
the fault and at least one photo.

5. Loyalty programme
The Larkspur Circle programme is free to join. Members earn 1 point per dollar spent; 200 points convert to a $10 \
voucher. Points expire after 18 months without a purchase. Members who spend over $1,000 in a calendar year reach \
Evergreen tier, which adds free express delivery and early access to seasonal sales. Points cannot be transferred \
between accounts.

6. Price adjustments
If an item we sold drops in price within 14 days of purchase, the customer may request a one-time refund of the \
difference. We do not match competitors' prices, and adjustments never apply to clearance events or to \
bundle discounts.

7. Payments and promotions
We accept major credit cards, debit cards, PayPal and Larkspur gift cards. Buy-now-pay-later is available on \
orders between $150 and $3,000. Only one promotional code can be used per order, and codes cannot be applied \
after checkout. Student and military discounts of 10 percent require verification through our partner before \
the order is placed.

8. Account security and privacy
Never ask for full card numbers, passwords or one-time codes. To discuss an existing order, confirm the order \
number together with the email address or postcode on the order. Customers can request deletion of their data \
from the privacy page; deletion completes within 30 days.

9. Escalation
Hand the conversation to a human agent when the customer asks for one, when a refund above $500 is requested, \
when there is a safety issue such as a burning smell, sparks or a collapsed item, when a legal threat is made, or \
after two failed attempts to resolve the problem. For safety issues, tell the customer to stop using the product \
and unplug it before anything else. Human agents are available from 8 am to 10 pm Eastern, seven days a week; \
outside those hours, promise a callback on the next business morning.

10. Things you must not do
Do not promise delivery dates the carrier has not confirmed. Do not give legal, medical or electrical installation \
advice beyond the product manual; recommend a licensed electrician for hard-wired lighting. Do not invent \
policies: if a situation is not covered here, say you will check with a colleague."""

# (question, short answer that appears verbatim in MANUAL)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("How much does standard shipping cost on a $45 order?", "$6.95"),
    ("What's the minimum order value for free standard delivery?", "$60"),
    ("If I order express before lunch, when will it arrive?", "1 to 2 business days"),
    ("How much is express delivery?", "$14.95"),
    ("What's the cutoff time for express orders?", "2 pm Eastern"),
    ("Do you ship to Hawaii?", "Hawaii"),
    ("How much extra is white-glove delivery for a sofa?", "$79"),
    ("I just ordered a lamp by mistake, can I still cancel it?", "1 hour"),
    ("How long do I have to return a chair I don't like?", "45 days"),
    ("Is return shipping free?", "$8"),
    ("I opened a blender and don't want it anymore. Will I get all my money back?", "15 percent"),
    ("How long is the mattress trial?", "100-night"),
    ("Can I return a custom-cut rug?", "custom-cut rugs"),
    ("When will I see my refund after sending something back?", "7 business days"),
    ("My vase arrived broken. How long do I have to report it?", "14 days"),
    ("Do I have to send the damaged item back?", "unless we ask for it"),
    ("What's the warranty on a Larkspur dining table?", "5-year"),
    ("How long is the warranty on a Larkspur toaster?", "2-year"),
    ("Does the warranty cover using my indoor bench on the patio?", "outdoor use of indoor items"),
    ("What do I need to file a warranty claim?", "at least one photo"),
    ("Is there a fee to join the loyalty programme?", "free to join"),
    ("How many points do I earn per dollar?", "1 point per dollar"),
    ("How many points do I need for a voucher?", "200 points"),
    ("How much is a loyalty voucher worth?", "$10"),
    ("Do my points ever expire?", "18 months"),
    ("How do I reach Evergreen tier?", "$1,000"),
    ("Can I give my points to my sister?", "cannot be transferred"),
    ("The sofa I bought last week is now cheaper. Can I get the difference back?", "within 14 days of purchase"),
    ("Will you match the price a competitor is offering?", "We do not match competitors' prices"),
    ("Can I pay in installments for a $120 order?", "between $150 and $3,000"),
    ("Can I use two discount codes on one order?", "one promotional code"),
    ("What's the student discount?", "10 percent"),
    ("Which payment methods do you take?", "PayPal"),
    ("What do you need from me to look up my order?", "email address or postcode"),
    ("How long does it take to delete my account data?", "30 days"),
    ("My kettle is sparking. What should I do?", "unplug it"),
    ("When can I speak to a human?", "8 am to 10 pm Eastern"),
    ("I want a $700 refund. Can you process it?", "above $500"),
    ("What happens if I contact you at midnight and need a person?", "next business morning"),
    ("Can you tell me how to wire the ceiling light myself?", "licensed electrician"),
    ("What's your assistant's name?", "Juniper"),
    ("My tracking hasn't updated in a week. What can you do?", "carrier trace"),
    ("Can you ship to my PO box?", "PO boxes"),
    ("Does the price adjustment apply during the clearance event?", "clearance events"),
    ("Can I apply a promo code after I've already paid?", "cannot be applied after checkout"),
)
