"""Generators for the long "pasted" blocks users drop into chat turns (code, logs, clauses, tables...).

Each generator is a pure function of a seeded ``random.Random`` and the conversation's slot values, so a
conversation that mentions ``{db}`` or ``{city}`` gets a paste that is consistent with it. Pastes are what
make some turns multi-paragraph: benchmarks need a realistic mix of tiny and very long user messages.
"""
from __future__ import annotations

import random
from collections.abc import Callable

Slots = dict[str, str]
PasteFn = Callable[[random.Random, Slots], str]

_IDENTS = ("records", "rows", "events", "orders", "items", "payload", "entries", "batch")
_KEYS = ("id", "order_id", "event_id", "sku", "user_id", "invoice_no")


def python_code(rng: random.Random, s: Slots) -> str:
    coll, key = rng.choice(_IDENTS), rng.choice(_KEYS)
    variants = (
        f"def dedupe_{coll}({coll}):\n    seen = {{}}\n    for r in {coll}:\n"
        f"        if r['{key}'] in seen:\n            if r['updated_at'] < seen[r['{key}']]['updated_at']:\n"
        f"                seen[r['{key}']] = r\n        else:\n            seen[r['{key}']] = r\n"
        f"    return list(seen.values())\n",
        f"def chunk_{coll}({coll}, size=50):\n    out = []\n    for i in range(0, len({coll}) - 1, size):\n"
        f"        out.append({coll}[i:i + size])\n    return out\n\n\n"
        f"def submit_all(client, {coll}):\n    for part in chunk_{coll}({coll}):\n"
        f"        resp = client.post('/bulk', json=part)\n        if resp.status_code != 200:\n"
        f"            print('failed', resp.text)\n",
        f"import csv\nfrom datetime import datetime\n\n\ndef load_{coll}(path):\n    result = []\n"
        f"    with open(path) as fh:\n        for row in csv.DictReader(fh):\n"
        f"            row['created'] = datetime.strptime(row['created'], '%d/%m/%Y')\n"
        f"            row['{key}'] = int(row['{key}'])\n            result.append(row)\n"
        f"    result.sort(key=lambda r: r['created'])\n    return result\n",
        "import time\nimport requests\n\n\ndef fetch_with_retry(url, attempts=5):\n    delay = 1\n"
        "    for attempt in range(attempts):\n        try:\n            resp = requests.get(url, timeout=3)\n"
        "            resp.raise_for_status()\n            return resp.json()\n        except Exception:\n"
        "            time.sleep(delay)\n            delay * 2\n    return None\n",
    )
    # Match the snippet to the task the user described, when the conversation named one.
    task = s.get("task", "")
    hint = next((i for i, kw in enumerate(("dedup", "batch", "date", "retr")) if kw in task), None)
    return (variants[hint] if hint is not None else rng.choice(variants)).rstrip()


def traceback(rng: random.Random, s: Slots) -> str:
    errors = (
        ("KeyError", "'updated_at'"),
        ("TypeError", "'<' not supported between instances of 'str' and 'datetime.datetime'"),
        ("ValueError", "time data '2024-03-07' does not match format '%d/%m/%Y'"),
        ("AttributeError", "'NoneType' object has no attribute 'json'"),
        ("sqlalchemy.exc.OperationalError", "(psycopg2.OperationalError) server closed the connection unexpectedly"),
    )
    etype, msg = rng.choice(errors)
    frames = rng.sample(("app/services/sync.py", "app/repositories/orders.py", "app/api/routes.py",
                         "app/workers/queue.py", "app/utils/io.py"), 3)
    lines = ["Traceback (most recent call last):"]
    for f in frames:
        fn = rng.choice(("run", "handle", "process_batch", "load", "sync_once", "_apply"))
        lines.append(f'  File "/srv/app/{f}", line {rng.randint(12, 480)}, in {fn}')
        lines.append(f"    result = {fn}({rng.choice(_IDENTS)})")
    lines.append(f"{etype}: {msg}")
    return "\n".join(lines)


def log_lines(rng: random.Random, s: Slots) -> str:
    svc = s.get("service", "checkout-api")
    msgs = (
        ("INFO", "request completed status=200 duration_ms={n}"),
        ("INFO", "cache miss key=session:{n}"),
        ("WARN", "slow query detected duration_ms={n} table=orders"),
        ("WARN", "connection pool at {p}% capacity"),
        ("ERROR", "upstream timeout after {n}ms host=payments.internal"),
        ("ERROR", "failed to acquire db connection within 5000ms"),
        ("INFO", "retrying job id={n} attempt=2"),
        ("WARN", "GC pause {n}ms exceeds threshold"),
        ("ERROR", "OOMKilled: container memory limit 2Gi reached"),
    )
    day, hh, mm, ss = rng.randint(10, 12), rng.randint(0, 23), rng.randint(0, 59), 0
    out = []
    for _ in range(rng.randint(9, 22)):
        ss += rng.randint(1, 9)
        mm, ss = (mm + ss // 60) % 60, ss % 60
        lvl, msg = rng.choice(msgs)
        msg = msg.replace("{n}", str(rng.randint(40, 9800))).replace("{p}", str(rng.randint(80, 100)))
        pod = f"{svc}-{rng.choice(('7d9f', '5c2a', '8b1e'))}"
        out.append(f"2024-05-{day:02d}T{hh:02d}:{mm:02d}:{ss:02d}Z {lvl:<5} [{pod}] {msg}")
    return "\n".join(out)


def sql_schema(rng: random.Random, s: Slots) -> str:
    extra = rng.sample(("discount_cents INTEGER", "channel TEXT", "region TEXT", "coupon_code TEXT",
                        "refunded_at TIMESTAMP"), 2)
    return (
        "CREATE TABLE customers (\n  id BIGSERIAL PRIMARY KEY,\n  email TEXT NOT NULL UNIQUE,\n"
        "  signup_date DATE NOT NULL,\n  plan TEXT NOT NULL\n);\n\n"
        "CREATE TABLE orders (\n  id BIGSERIAL PRIMARY KEY,\n  customer_id BIGINT REFERENCES customers(id),\n"
        f"  created_at TIMESTAMP NOT NULL,\n  total_cents INTEGER NOT NULL,\n  {extra[0]},\n  {extra[1]}\n);\n\n"
        "-- my attempt\nSELECT c.plan, date_trunc('month', o.created_at) AS month, SUM(o.total_cents) / 100 AS "
        "revenue\nFROM customers c LEFT JOIN orders o ON o.customer_id = c.id\nWHERE o.created_at >= '2024-01-01'\n"
        "GROUP BY c.plan\nORDER BY month;"
    )


def csv_rows(rng: random.Random, s: Slots) -> str:
    rows = ["date,region,channel,orders,revenue_usd"]
    for day in range(1, rng.randint(11, 19)):
        rows.append(f"2024-04-{day:02d},{rng.choice(('north', 'south', 'east', 'west'))},"
                    f"{rng.choice(('web', 'app', 'retail'))},{rng.randint(80, 950)},"
                    f"{rng.randint(2000, 40000)}.{rng.randint(0, 99):02d}")
    return "\n".join(rows)


def k8s_yaml(rng: random.Random, s: Slots) -> str:
    svc = s.get("service", "checkout-api")
    return (
        f"apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {svc}\nspec:\n  replicas: {rng.randint(2, 6)}\n"
        f"  template:\n    spec:\n      containers:\n        - name: {svc}\n"
        f"          image: registry.local/{svc}:1.{rng.randint(10, 40)}.{rng.randint(0, 9)}\n"
        f"          resources:\n            requests:\n              cpu: {rng.choice(('250m', '500m'))}\n"
        "              memory: 1Gi\n"
        "            limits:\n              memory: 2Gi\n          readinessProbe:\n            httpGet:\n"
        "              path: /healthz\n"
        f"              port: 8080\n            initialDelaySeconds: {rng.choice((1, 2, 5))}\n"
        "            timeoutSeconds: 1"
    )


_CLAUSES = (
    "Limitation of Liability. In no event shall either party be liable to the other for any indirect, incidental, "
    "consequential, special or punitive damages, including lost profits, arising out of or relating to this Agreement, "
    "except that this limitation shall not apply to breaches of Section 7 (Confidentiality) or to a party's "
    "indemnification obligations.",
    "Term and Termination. This Agreement commences on the Effective Date and continues for an initial term of "
    "thirty-six (36) months. Thereafter it renews automatically for successive twelve (12) month periods unless either "
    "party gives written notice of non-renewal at least ninety (90) days before the end of the then-current term.",
    "Confidentiality. The Receiving Party shall hold the Disclosing Party's Confidential Information in strict "
    "confidence, shall "
    "use it solely to perform its obligations hereunder, and shall not disclose it to any third party other than "
    "employees and "
    "contractors bound by written obligations at least as protective as those set out herein.",
    "Indemnification. {b} shall defend, indemnify and hold harmless {a} from any third-party claim alleging that the "
    "Services infringe a patent, copyright or trade secret, provided that {a} promptly notifies {b} in writing and "
    "grants {b} sole control of the defense.",
    "Payment Terms. {a} shall pay all undisputed invoices within forty-five (45) days of receipt. Late amounts bear "
    "interest at the lesser of one percent (1%) per month or the maximum rate permitted by law. Disputed amounts must "
    "be identified in writing within fifteen (15) days.",
    "Assignment. Neither party may assign this Agreement without the prior written consent of the other, except that "
    "either party may "
    "assign it to a successor in connection with a merger, acquisition or sale of all or substantially all of its "
    "assets.",
    "Non-Solicitation. During the term and for twelve (12) months thereafter, neither party shall directly solicit for "
    "employment any employee of the other party who was materially involved in the performance of this Agreement.",
    "Governing Law. This Agreement is governed by the laws of the State of Delaware, without regard to its "
    "conflict-of-laws rules, and the parties submit to the exclusive jurisdiction of the courts located in Wilmington, "
    "Delaware.",
)


def contract_clauses(rng: random.Random, s: Slots) -> str:
    a, b = s.get("party_a", "Customer"), s.get("party_b", "Vendor")
    picked = sorted(rng.sample(range(len(_CLAUSES)), rng.randint(2, 4)))
    section = rng.randint(8, 14)
    return "\n\n".join(f"{section}.{n + 1} " + _CLAUSES[c].replace("{a}", a).replace("{b}", b)
                       for n, c in enumerate(picked))


_ESSAY = (
    "Remote work has changed how small teams think about trust, and in my experience the change is mostly for the "
    "better.",
    "When nobody can see you at your desk, the only thing left to judge is the work itself.",
    "That sounds liberating, but it also means that quiet people who used to be noticed for showing up early now "
    "disappear.",
    "Our team tried to fix this with more meetings, which, predictably, made everything worse.",
    "What finally helped was writing things down: decisions, reasons, and the questions we could not answer yet.",
    "A shared document is a strange place to build a culture, but it is a fair one.",
    "The downside is that writing takes time, and not everyone enjoys it or is good at it.",
    "I do not think the office is coming back in the form we remember, and I am not sure we should want it to.",
    "Still, there are moments, like onboarding a new hire, where being in the same room is simply faster.",
    "In the end the question is not where people work but how clearly they can tell each other what they need.",
    "Critics argue that productivity numbers from the last few years are too noisy to support any conclusion.",
    "They may be right, but the people I manage are not numbers, and most of them are happier.",
)


def essay_draft(rng: random.Random, s: Slots) -> str:
    paras = []
    for _ in range(rng.randint(2, 3)):
        paras.append(" ".join(rng.sample(_ESSAY, rng.randint(3, 5))))
    return "\n\n".join(paras)


def itinerary(rng: random.Random, s: Slots) -> str:
    city = s.get("city", "Lisbon")
    acts = ("walking tour of the old town", "museum in the morning, market lunch", "day trip by train",
            "free day / shopping", "cooking class", "boat tour at sunset", "hike to the viewpoint",
            "food market and street-art walk", "beach or park afternoon")
    days = rng.randint(3, 6)
    lines = [f"Day {d + 1}: {a}" for d, a in enumerate(rng.sample(acts, days))]
    lines.append(f"Day {days + 1}: late check-out, airport by {rng.choice(('11am', '3pm', '6pm'))}")
    hotel = rng.choice(('central, 4 stars', 'apartment near the station', 'boutique hotel by the river'))
    return f"Current plan for {city}:\n" + "\n".join(lines) + f"\nHotel: {hotel}"


def email_thread(rng: random.Random, s: Slots) -> str:
    product = s.get("product", "the router")
    return (
        f"From: support@{s.get('company', 'example').split()[0].lower()}.com\n"
        f"Subject: Re: Ticket #{rng.randint(100000, 999999)}\n\n"
        f"Hello,\n\nThank you for contacting us about {product}. We have reviewed your account and can confirm "
        f"that a technician visit was scheduled for {rng.choice(('Tuesday', 'Thursday', 'Saturday'))} between "
        f"{rng.choice(('8am and 12pm', '1pm and 5pm'))}. Our records show the technician marked the visit as "
        f"'customer not home'. A new visit fee of ${rng.choice((35, 49, 59))} applies unless the visit is rebooked "
        "within 7 days.\n\nIf you believe this is an error, reply to this email with photos of the equipment.\n\n"
        "Kind regards,\nThe Support Team"
    )


def recipe(rng: random.Random, s: Slots) -> str:
    items = ("2 onions, diced", "3 cloves garlic", "400g canned tomatoes", "1 tbsp smoked paprika", "250g red lentils",
             "1 litre vegetable stock", "200ml coconut milk", "1 tsp cumin", "a handful of spinach", "juice of 1 lime",
             "500g chicken thighs", "1 tbsp olive oil", "salt and pepper")
    ing = rng.sample(items, rng.randint(6, 10))
    return ("Ingredients:\n" + "\n".join(f"- {i}" for i in ing) +
            "\n\nMethod: soften the onions in oil, add garlic and spices, then everything else. "
            f"Simmer {rng.choice((20, 30, 45))} minutes. Serves {rng.choice((2, 4, 6))}.")


def workout_log(rng: random.Random, s: Slots) -> str:
    days = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
    acts = ("squat 5x5 @ {w}kg", "bench 3x8 @ {w}kg", "easy run {k} km", "rest", "deadlift 3x5 @ {w}kg",
            "intervals 6x400m", "long run {k} km", "pull-ups 4x6, rows 3x10", "yoga 30 min")
    return "\n".join(f"{d}: " + rng.choice(acts).replace("{w}", str(rng.randint(40, 120)))
                     .replace("{k}", str(rng.randint(4, 18))) for d in days)


def transactions(rng: random.Random, s: Slots) -> str:
    payees = ("Rent", "Grocery Mart", "Streaming service", "Gym membership", "Coffee shop", "Electric utility",
              "Phone plan", "Restaurant", "Ride share", "Online shopping", "Car insurance", "Pharmacy")
    lines = ["Date       | Description            | Amount"]
    for d in sorted(rng.sample(range(1, 29), rng.randint(9, 16))):
        p = rng.choice(payees)
        amt = rng.randint(1200, 1900) if p == "Rent" else rng.randint(4, 160)
        lines.append(f"2024-03-{d:02d} | {p:<22} | -{amt}.{rng.randint(0, 99):02d}")
    lines.append(f"2024-03-28 | Salary                 | +{rng.randint(3200, 5600)}.00")
    return "\n".join(lines)


def job_post(rng: random.Random, s: Slots) -> str:
    role = s.get("role", "Backend Engineer")
    reqs = rng.sample(("5+ years of professional experience", "strong communication skills",
                       "experience with cloud platforms",
                       "a degree in computer science or equivalent", "comfort working across time zones",
                       "experience mentoring junior colleagues", "familiarity with agile ways of working",
                       "ninja-level problem solving", "willingness to wear many hats"), 5)
    return (f"We are looking for a rockstar {role} to join our fast-paced, work-hard-play-hard team!\n\n"
            "What you'll do:\n- Own projects end to end\n- Collaborate with stakeholders\n- Move fast and ship\n\n"
            "What we're looking for:\n" + "\n".join(f"- {r}" for r in reqs) +
            f"\n\nSalary: competitive. Location: hybrid, {rng.choice(('3', '4'))} days in office.")


def spanish_text(rng: random.Random, s: Slots) -> str:
    sents = ("Ayer yo fui a la playa con mis amigos y nosotros comimos mucho pescado.",
             "Cuando era niño, yo vivo en una casa muy grande cerca del río.",
             "Mi hermana es más alta que yo, pero yo soy más rápido de ella.",
             "El fin de semana pasado, hacía mucho calor y nosotros estuvimos en la piscina todo el día.",
             "Si yo tengo más dinero, yo viajaría a México para aprender español.",
             "Me gusta mucho los libros de historia, especialmente sobre la guerra civil.",
             "Espero que mañana hace buen tiempo porque quiero ir al mercado.",
             "Mi profesor dice que yo necesito practicar el subjuntivo más.")
    return " ".join(rng.sample(sents, rng.randint(3, 6)))


def math_work(rng: random.Random, s: Slots) -> str:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"Problem: find the derivative of f(x) = {a}x^3 * sin(x) + {b}/x\n\n"
            f"My work:\nf'(x) = {3 * a}x^2 * cos(x) + {b}/x^2\n"
            "I used the power rule on the first part and the quotient rule on the second.\n"
            "The answer key says something with both sin and cos in it and a minus sign, so I'm confused.")


_HISTORY = (
    "Historians have long debated whether {era} was caused mainly by long-term structural change or by short-term "
    "crises.",
    "On one side, economic historians point to rising prices, debt and a tax system that no longer worked.",
    "On the other side, intellectual historians stress new ideas about authority, rights and the nation.",
    "In my view these explanations are not really opposed, because ideas spread fastest when people are already "
    "struggling.",
    "The ruling elite also made a series of decisions that turned manageable problems into a crisis of legitimacy.",
    "Contemporaries did not experience these causes separately; pamphlets, prices and rumours reached them all at "
    "once.",
    "Recent work on provincial archives suggests that local grievances mattered more than events in the capital.",
    "This essay will argue that economic pressure was necessary but not sufficient, and that politics decided the "
    "outcome.",
)


def history_draft(rng: random.Random, s: Slots) -> str:
    era = s.get("era", "the period")
    return "\n\n".join(" ".join(rng.sample(_HISTORY, rng.randint(3, 5))).replace("{era}", era)
                        for _ in range(rng.randint(1, 2)))


_NOTES = (
    "doesn't trust the export, re-checks numbers by hand every week",
    "uses a spreadsheet as the source of truth, app is 'just for the boss'",
    "biggest pain: errors only show after the whole upload finishes",
    "would pay more if it saved them an hour on Mondays",
    "IT department blocks anything that needs a browser extension",
    "confused by the difference between draft and archived items",
    "asked three times whether we keep a history of changes",
    "works mostly on a tablet in the field, bad connection",
    "wants to invite an outside accountant with read-only access",
    "said the competitor's version is 'ugly but works'",
)


def interview_notes(rng: random.Random, s: Slots) -> str:
    out = []
    for n in range(1, rng.randint(3, 5)):
        role = rng.choice(("ops manager", "team lead", "admin", "field technician", "finance clerk"))
        out.append(f"Interview {n} ({role}, {rng.randint(5, 400)}-person company):\n"
                   + "\n".join(f"- {x}" for x in rng.sample(_NOTES, rng.randint(3, 5))))
    return "\n\n".join(out)


PASTES: dict[str, PasteFn] = {
    "history_draft": history_draft, "interview_notes": interview_notes,
    "python_code": python_code, "traceback": traceback, "log_lines": log_lines, "sql_schema": sql_schema,
    "csv_rows": csv_rows, "k8s_yaml": k8s_yaml, "contract_clauses": contract_clauses, "essay_draft": essay_draft,
    "itinerary": itinerary, "email_thread": email_thread, "recipe": recipe, "workout_log": workout_log,
    "transactions": transactions, "job_post": job_post, "spanish_text": spanish_text, "math_work": math_work,
}
