"""Synthetic encyclopedia-style documents with invented, checkable facts for the RAG workload.

Every fact value (a year, a name, a count...) is drawn through ``_Unique`` so no value is a substring of
another one anywhere in the pool; filler sentences contain no digits and no proper names. Together that
makes each answer string occur in exactly one document, so a QA item is unambiguous no matter which
distractor documents are packed next to it.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

_SYL_A = ("Vel", "Cor", "Bram", "Ost", "Kel", "Thar", "Mir", "Lun", "Pell", "Quar", "Dun", "Harr", "Ebb", "Fen",
          "Gal", "Iver", "Jor", "Wyn", "Sol", "Tor", "Ash", "Brin", "Cald", "Elm", "Hesk", "Marl", "Ravn", "Skel")
_SYL_B = ("mora", "valis", "hollow", "wick", "stead", "mere", "ford", "bury", "haven", "crest", "gate", "lyn",
          "dale", "ridge", "moor", "thorpe", "wen", "ness")
_FIRST = ("Ingrid", "Tomasz", "Amara", "Lucien", "Priya", "Okonkwo", "Mireille", "Desmond", "Yuki", "Ansel",
          "Beatriz", "Casimir", "Dagny", "Emeka", "Florian", "Greta", "Hamid", "Isolde", "Jasper", "Kalinda",
          "Leopold", "Marisol", "Niamh", "Osvaldo", "Rosalind", "Stellan", "Thea", "Ulrich", "Wilhelmina", "Zoltan")
_LAST = ("Halvorsen", "Brankovic", "Adeyemi", "Fairbrother", "Castellanos", "Lindqvist", "Okafor", "Vasquez-Rey",
         "Thornbury", "Marchetti", "Kowalczyk", "Delacroix", "Nakamura", "Abernathy", "Szabo", "Oyelaran",
         "Montague", "Rasmussen", "Quillfeather", "Everly", "Grunwald", "Petrakis", "Achterberg", "Moravec",
         "Sandoval", "Whitlock", "Iyengar", "Corrigan", "Vantongeren", "Lachance")
_ADJ = ("Lantern", "Quiet", "Copper", "Hollow", "Salt", "Northern", "Paper", "Glass", "Amber", "Drowned", "Iron",
        "Winter")
_NOUN = ("Tables", "Harbour", "Orchard", "Ledger", "Cartographer", "Meridian", "Foundry", "Choir", "Archive", "Tide")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_EXPORTS = ("slate roofing tiles", "smoked trout", "hand-blown glass", "cider vinegar", "wool blankets",
            "church bells", "pickled walnuts", "linen thread", "beeswax candles", "clay pipes")
_EVENTS = ("midnight rope-bridge race", "quayside lantern procession", "kite-fighting tournament",
           "forty-choir singing contest", "canal raft regatta", "bread-baking marathon")


class _Unique:
    """Hands out values that are neither equal to nor substrings of anything handed out before."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def take(self, rng: random.Random, make: Callable[[random.Random], str]) -> str:
        for _ in range(500):
            v = make(rng)
            if not any(v in u or u in v for u in self.used):
                self.used.append(v)
                return v
        raise RuntimeError("value space exhausted; widen the vocabulary")


def _place(r: random.Random) -> str:
    return r.choice(_SYL_A) + r.choice(_SYL_B)


def _person(r: random.Random) -> str:
    return f"{r.choice(_FIRST)} {r.choice(_LAST)}"


_MAKERS: dict[str, Callable[[random.Random], str]] = {
    "place": _place,
    "person": _person,
    "year": lambda r: str(r.randint(1841, 2011)),
    "count": lambda r: f"{r.randint(1200, 48000):,}",
    "money": lambda r: f"${r.randint(12, 980)} million",
    "product": lambda r: f"{r.choice(_SYL_A)}{r.choice(('ion', 'ex', 'ar', 'o'))} "
                         f"{r.choice('KTXRVZ')}{r.randint(2, 99)}",
    "meters": lambda r: f"{r.randint(140, 4800):,} meters",
    "river": lambda r: f"{r.choice(_SYL_A)}{r.choice(('el', 'an', 'ith', 'ow'))} River",
    "title": lambda r: f"The {r.choice(_ADJ)} {r.choice(_NOUN)}",
    "award": lambda r: f"{r.choice(_LAST)} Medal",
    "institute": lambda r: f"{_place(r)} Institute",
    "species": lambda r: f"{r.choice(('Varan', 'Lepid', 'Cryo', 'Thal', 'Orn'))}opsis "
                         f"{r.choice(_LAST).lower().replace('-', '')}i",
    "scientists": lambda r: f"{r.randint(11, 97)} scientists",
    "date": lambda r: f"{r.randint(1, 28)} {r.choice(_MONTHS)} {r.randint(1995, 2023)}",
    "price": lambda r: f"${r.randint(99, 1899)}",
    "hours": lambda r: f"{r.randint(6, 72)} hours",
    "grams": lambda r: f"{r.randint(140, 1900)} grams",
    "codename": lambda r: r.choice(("Blue", "Red", "Grey", "Gold", "Black", "White")) + r.choice(
        ("finch", "heron", "marten", "otter", "wren", "lynx", "falcon", "hare")),
    "export": lambda r: r.choice(_EXPORTS),
    "event": lambda r: r.choice(_EVENTS),
    "days": lambda r: f"{r.randint(3, 16)} days",
}


@dataclass(frozen=True)
class Fact:
    key: str
    maker: str                     # key into _MAKERS
    sentences: tuple[str, ...]     # one is drawn; uses {name} and {v}
    question: str | None           # None: the fact is context only, never asked


@dataclass(frozen=True)
class DocKind:
    kind: str
    name_maker: Callable[[random.Random], str]
    title: str
    intro: str
    facts: tuple[Fact, ...]
    fillers: tuple[str, ...]


@dataclass
class Doc:
    doc_id: str
    kind: str
    title: str
    text: str
    qa: list[tuple[str, str]] = field(default_factory=list)  # (question, answer) candidates


_SUFFIX = ("Robotics", "Textiles", "Biosciences", "Freight", "Ceramics", "Analytics", "Instruments", "Foods")

KINDS: tuple[DocKind, ...] = (
    DocKind("company", lambda r: f"{_place(r)} {r.choice(_SUFFIX)}", "{name}",
            "{name} is a privately held manufacturer and services firm with customers in several countries.",
            (Fact("founded", "year", ("{name} was founded in {v} in a rented workshop.",
                                      "The company traces its origins to {v}, when it opened its first workshop."),
                  "In what year was {name} founded?"),
             Fact("founder", "person", ("Its founder, {v}, had previously worked as a railway engineer.",
                                        "The business was started by {v}, a former railway engineer."),
                  "Who founded {name}?"),
             Fact("hq", "place", ("Its headquarters are in the town of {v}.", "The firm is headquartered in {v}."),
                  "In which town is {name} headquartered?"),
             Fact("employees", "count", ("Today {name} employs {v} people.",
                                         "The company has a workforce of {v} employees."),
                  "How many people does {name} employ?"),
             Fact("product", "product", ("Its best-selling product is the {v}.",
                                         "The {v} remains its best-selling product."),
                  "What is the name of {name}'s best-selling product?"),
             Fact("revenue", "money", ("Last year it reported revenue of {v}.",
                                       "Annual revenue reached {v} last year."),
                  "What annual revenue did {name} report last year?"),
             Fact("ceo", "person", ("The current chief executive is {v}.",
                                    "{v} has served as chief executive since the last restructuring."),
                  "Who is the current chief executive of {name}?")),
            ("The company grew slowly at first, relying on word of mouth among regional distributors.",
             "Analysts often describe its culture as cautious, with a strong preference for paying down debt before "
             "expanding.",
             "During the last decade it invested heavily in automation, although it kept most of its original staff.",
             "A small research group works on materials and process improvements and publishes occasional technical "
             "notes.",
             "Customers praise the durability of its products but complain about long delivery times.",
             "The firm has avoided acquisitions, preferring to build new capabilities internally.",
             "Several former employees have gone on to found competitors in neighbouring markets.",
             "Its annual reports emphasise long-term contracts rather than one-off sales.",
             "The company sponsors apprenticeships and a modest scholarship programme for local students.",
             "Trade publications have repeatedly listed it among the better-managed mid-sized firms in its sector.",
             "Labour relations have generally been calm, with disputes settled through a joint works council.",
             "Export sales now account for a large share of its business, mostly through long-standing partners.",
             "Its purchasing team favours suppliers within a day's drive, which it says shortens lead times and makes "
             "quality problems easier to resolve in person.",
             "When demand collapsed during a regional recession, management cut executive pay and shortened the "
             "working "
             "week rather than laying off staff, a decision that is still cited in business school case studies.",
             "Competitors have tried to copy its service contracts, which bundle maintenance, spare parts and operator "
             "training into a single annual fee.",
             "The board includes two representatives elected by employees, an arrangement written into the articles of "
             "association when the founder stepped back from daily management.")),
    DocKind("town", _place, "{name} (town)",
            "{name} is a market town known for its stone bridges, narrow lanes and weekly farmers' market.",
            (Fact("population", "count", ("At the most recent census {name} had a population of {v}.",
                                          "The town is home to {v} residents."), "What is the population of {name}?"),
             Fact("river", "river", ("It lies on the banks of the {v}.",
                                     "The {v} flows through the centre of the town."),
                  "Which river flows through {name}?"),
             Fact("elevation", "meters", ("The old town sits at an elevation of {v} above sea level.",
                                          "Its central square stands {v} above sea level."),
                  "At what elevation does {name} lie?"),
             Fact("mayor", "person", ("The current mayor is {v}.",
                                      "{v} was elected mayor at the last municipal election."),
                  "Who is the mayor of {name}?"),
             Fact("chartered", "year", ("{name} received its town charter in {v}.",
                                        "The town charter was granted in {v}."),
                  "In what year did {name} receive its town charter?"),
             Fact("export", "export", ("For generations the town has been known for its {v}.",
                                       "Local workshops still produce {v}, the product the town is best known for."),
                  "What product is {name} best known for?")),
            ("The surrounding countryside is mostly pasture, broken by small woods and dry-stone walls.",
             "Tourism has grown steadily, especially among walkers following the long-distance trail that passes "
             "nearby.",
             "The parish church, rebuilt after a fire, dominates the skyline from the approach road.",
             "A branch railway once served the town but closed long ago; its route is now a cycle path.",
             "Housing pressure has become a local political issue as second homes multiply.",
             "The weekly market draws traders from across the region and fills the main square.",
             "Winters can be harsh, and the upper lanes are sometimes cut off by snow.",
             "A small museum in the former grammar school documents local crafts and trades.",
             "The town band, founded by mill workers, still performs on summer evenings.",
             "Several medieval merchant houses survive along the main street, protected as listed buildings.",
             "Local schools have struggled to recruit teachers, and the council offers housing support to newcomers.",
             "Flooding has been a recurring problem, and a new set of embankments and sluice gates was completed after "
             "a particularly wet winter damaged dozens of homes along the lower streets.",
             "The town's dialect preserves several words for weather and farm tools that linguists have not recorded "
             "anywhere else in the region.",
             "An annual footrace up the hill behind the church attracts runners from far away, and the record for the "
             "course is the subject of fierce local pride.",
             "Most residents now commute to larger towns for work, but the high street has kept an unusual number of "
             "independent shops, including a bookbinder and a saddler.")),
    DocKind("person", _person, "{name}",
            "{name} is a scholar and writer whose work crosses the boundaries between history, geography and "
            "literature.",
            (Fact("born", "year", ("{name} was born in {v}.",
                                   "Born in {v}, {name} grew up in a family of booksellers."),
                  "In what year was {name} born?"),
             Fact("birthplace", "place", ("{name} grew up in the town of {v}.", "{name} spent childhood years in {v}."),
                  "In which town did {name} grow up?"),
             Fact("book", "title", ("The best-known book by {name} is {v}.",
                                    "{name} is best remembered for the book {v}."),
                  "What is the title of {name}'s best-known book?"),
             Fact("award", "award", ("The work earned {name} the {v}.", "{name} was later awarded the {v}."),
                  "Which award did {name} receive?"),
             Fact("institution", "institute", ("Most of that career was spent at the {v}.",
                                               "{name} taught for many years at the {v}."),
                  "At which institution did {name} spend most of their career?")),
            ("Colleagues remember a demanding but generous teacher who answered every letter.",
             "The early work was largely ignored, and recognition came only in middle age.",
             "Critics have argued that the later books rely too heavily on anecdote.",
             "A long correspondence with fellow researchers has been published in several volumes.",
             "Field notebooks, kept in meticulous handwriting, are now held in a university archive.",
             "The writing is admired for its clarity and for its attention to ordinary working lives.",
             "Translations have appeared in many languages, though some remain out of print.",
             "Former students describe seminars that ran for hours and often ended in the library.",
             "Public lectures drew large audiences, and several were broadcast on radio.",
             "Later in life the focus shifted towards maps and the history of surveying.",
             "Several biographies disagree about the reasons for a sudden move abroad in early adulthood.",
             "A habit of revisiting the same landscapes over decades produced a body of work that historians now use "
             "as a record of how rural communities changed.",
             "Disputes with publishers over editing were frequent, and at least one manuscript was withdrawn shortly "
             "before printing because of changes made without consent.",
             "Younger writers have credited these books with showing that careful scholarship and readable prose are "
             "not in conflict.",
             "A collected edition, with previously unpublished essays and a detailed bibliography, is being prepared "
             "by "
             "a team of former students.")),
    DocKind("station", lambda r: f"{_place(r)} {r.choice(('Ridge', 'Sound', 'Basin', 'Plateau'))} Research Station",
            "{name}", "{name} is a remote scientific outpost devoted to long-term ecological and climate monitoring.",
            (Fact("established", "year", ("The station was established in {v}.",
                                          "Construction of the station was completed in {v}."),
                  "In what year was {name} established?"),
             Fact("director", "person", ("Its director is {v}.", "The station is currently led by {v}."),
                  "Who is the director of {name}?"),
             Fact("altitude", "meters", ("The main laboratory stands at {v}.",
                                         "The buildings sit at an altitude of {v}."),
                  "At what altitude is {name} located?"),
             Fact("staff", "scientists", ("During the summer season it hosts {v}.",
                                          "At peak season the station houses {v}."),
                  "How many scientists does {name} host during the summer season?"),
             Fact("species", "species", ("Researchers there first described the salamander {v}.",
                                         "Its best-known discovery is the salamander {v}."),
                  "Which salamander species was first described by researchers at {name}?")),
            ("Supplies arrive by tracked vehicle, and in bad weather the station can be isolated for weeks.",
             "The monitoring programme records temperature, snow depth and soil moisture continuously.",
             "Visiting researchers must complete safety training before their first field season.",
             "Power comes from a mix of solar panels, small wind turbines and a backup generator.",
             "Data are shared openly with international partners after a short quality-control period.",
             "Long-term funding has been uncertain, and the station has survived several proposed closures.",
             "The common room doubles as a lecture hall and a library of field guides.",
             "Wildlife surveys have documented shifts in the ranges of several alpine plants.",
             "A permanent camera network photographs the surrounding slopes every hour.",
             "Students from partner universities spend part of their training at the station each year.",
             "Winter crews are small, and the routines of isolation are described in many memoirs.",
             "Instruments are calibrated against reference sensors every spring, and any drift is documented in a "
             "public log so that other groups can correct their own analyses.",
             "The station has a strict waste policy: everything brought in is carried out again, including food "
             "scraps, "
             "which are frozen and removed at the end of each season.",
             "Collaborations with local herders have produced a long record of snow conditions that predates the "
             "station's own instruments.",
             "Avalanche risk shapes daily routines, and fieldwork on the upper slopes is allowed only in pairs with a "
             "radio check every hour.")),
    DocKind("device", lambda r: f"{r.choice(_SYL_A)}{r.choice(_SYL_B)} {r.choice(('Slate', 'Pod', 'Scout', 'Loom'))}",
            "{name}", "The {name} is a portable consumer device aimed at outdoor and field users.",
            (Fact("released", "date", ("It was released on {v}.", "The device went on sale on {v}."),
                  "On what date was the {name} released?"),
             Fact("price", "price", ("Its launch price was {v}.", "At launch it cost {v}."),
                  "What was the launch price of the {name}?"),
             Fact("battery", "hours", ("The battery lasts about {v} under typical use.",
                                       "Typical battery life is {v}."),
                  "How long does the {name}'s battery last under typical use?"),
             Fact("weight", "grams", ("It weighs {v}.", "The device weighs {v} without accessories."),
                  "How much does the {name} weigh?"),
             Fact("codename", "codename", ("During development it carried the internal codename {v}.",
                                           "Engineers knew the project by the codename {v}."),
                  "What was the internal codename of the {name}?"),
             Fact("designer", "person", ("Its lead designer was {v}.", "The design team was led by {v}."),
                  "Who was the lead designer of the {name}?")),
            ("Reviewers praised the rugged case and the bright, readable screen.",
             "Early units suffered from a charging fault that was fixed in a later production run.",
             "The device can be operated with gloves, a feature aimed at mountain rescue teams.",
             "Accessories include a bicycle mount, a spare battery sleeve and a waterproof pouch.",
             "Software updates added offline maps and improved the accuracy of its sensors.",
             "Some users complained that the buttons were too stiff in cold weather.",
             "The packaging is made entirely from recycled cardboard.",
             "Repairability scores were high because most parts can be replaced with a single screwdriver.",
             "Sales were strongest among hikers, surveyors and agricultural inspectors.",
             "A smaller variant was discussed but never released.",
             "Independent tests confirmed its resistance to dust and brief immersion.",
             "The companion app lets users export their recorded tracks in common formats, which made the device "
             "popular with volunteer mapping groups.",
             "Its menus were designed with a professional rescue service, which is why the emergency beacon can be "
             "triggered with a single long press even when the screen is locked.",
             "Supply shortages delayed deliveries in several markets, and some early buyers waited months for their "
             "units.",
             "A community of enthusiasts maintains unofficial firmware that adds features the manufacturer never "
             "shipped.")),
    DocKind("festival", lambda r: f"{_place(r)} {r.choice(('Lantern', 'Harvest', 'Kite', 'Salt', 'Ember'))} Festival",
            "{name}", "The {name} is an annual celebration that combines music, crafts, food and an unusual contest.",
            (Fact("first", "year", ("The festival was first held in {v}.", "The first edition took place in {v}."),
                  "In what year was the {name} first held?"),
             Fact("attendance", "count", ("Last year it attracted {v} visitors.", "Recent editions drew {v} visitors."),
                  "How many visitors did the {name} attract last year?"),
             Fact("organizer", "person", ("It is organised by {v}.", "{v} has directed the festival for many years."),
                  "Who organises the {name}?"),
             Fact("duration", "days", ("Festivities last {v}.", "The programme runs for {v}."),
                  "How long does the {name} last?"),
             Fact("headline", "event", ("Its highlight is the {v}.",
                                        "The most popular part of the programme is the {v}."),
                  "What is the highlight of the {name}?")),
            ("Volunteers from neighbouring villages handle most of the logistics.",
             "Local bakers and brewers prepare special recipes that are sold only during the festival.",
             "Noise complaints led to an earlier closing time for the main stage.",
             "The festival has a strict rule that no single sponsor may name an event.",
             "Children's workshops teach traditional crafts such as weaving and woodcarving.",
             "Accommodation in the area is usually fully booked months in advance.",
             "The closing night ends with a procession to the river and a communal meal.",
             "Critics say the event has become too commercial, while organisers point to rising attendance.",
             "Musicians are chosen by a panel that favours regional traditions.",
             "A photography contest documents each edition, and the winning images are exhibited the next spring.",
             "Local historians trace the festival's customs to older harvest fairs, though the modern programme was "
             "largely invented by its first organisers.",
             "Ticket prices are kept deliberately low, and residents of the host town can attend most events for free.",
             "The festival publishes an environmental report every year, covering waste, water use and the share of "
             "visitors who arrive by public transport.",
             "Rain has forced the cancellation of outdoor events several times, prompting the construction of a "
             "large covered hall near the market square.")),
)


def build_docs(rng: random.Random, per_kind: int = 5) -> list[Doc]:
    """Build ``per_kind`` documents of every kind, interleaved, with globally unique fact values."""
    uniq = _Unique()
    order = [k for k in KINDS for _ in range(per_kind)]
    rng.shuffle(order)
    docs = []
    for i, kind in enumerate(order):
        name = uniq.take(rng, kind.name_maker)
        fact_sents, qa = [], []
        for fact in kind.facts:
            v = uniq.take(rng, _MAKERS[fact.maker])
            fact_sents.append(rng.choice(fact.sentences).format(name=name, v=v))
            if fact.question:
                qa.append((fact.question.format(name=name), v))
        fillers = rng.sample(kind.fillers, len(kind.fillers))
        target = rng.randint(170, 345)
        body = [kind.intro.format(name=name)] + fact_sents
        # Interleave filler after random facts until the target length, never past the 380-word ceiling.
        while fillers and sum(len(x.split()) for x in body) < target:
            f = fillers.pop()
            if sum(len(x.split()) for x in body) + len(f.split()) > 375:
                break
            body.insert(rng.randint(2, len(body)), f)
        paras, cur = [], []
        for sent in body:
            cur.append(sent)
            if len(cur) >= rng.randint(3, 5):
                paras.append(" ".join(cur))
                cur = []
        if cur:
            paras.append(" ".join(cur))
        docs.append(Doc(f"doc-{i:02d}", kind.kind, kind.title.format(name=name), "\n\n".join(paras), qa))
    return docs
