"""Training prompts for the drafter: chat, code and math, built only from material the project may use.

Sources:
  * chat: the project's own templates and word lists (topics, audiences, formats,
    personas, situations, writing forms);
  * code: the Python standard library itself (the first sentence of each public
    function's or method's docstring and its signature, read with ``inspect``) turned
    into coding and explanation tasks, plus the project's own list of programming tasks;
  * math: arithmetic word problems generated from templates with random numbers.

``training_prompts(n, seed)`` is deterministic for a given seed and Python version
(the stdlib docstrings differ slightly between versions) and never returns a prompt
that shares an ``OVERLAP_SPAN``-word span with a benchmark prompt (MT-Bench, HumanEval,
the project's math and repeat sets; see ``overlapping_prompts``). Prompts are short so
that the target's responses dominate the training tokens.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
import string
import unicodedata
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

KINDS = ("chat", "code", "math")
DEFAULT_MIX = {"chat": 0.45, "code": 0.35, "math": 0.20}
OVERLAP_SPAN = 8

# --------------------------------------------------------------------------- overlap


_PUNCT = set(string.punctuation)


def _strip_punct(text: str) -> str:
    return "".join(
        ch for ch in text
        if ch not in _PUNCT and not unicodedata.category(ch).startswith("P")
    )


def normalized_words(text: str) -> list[str]:
    """Lower-case ``text``, drop punctuation characters and split on whitespace."""
    return _strip_punct(text.lower()).split()


def word_spans(text: str, span: int = OVERLAP_SPAN) -> set[tuple[str, ...]]:
    """All runs of ``span`` consecutive normalized words in ``text`` (empty if shorter)."""
    words = normalized_words(text)
    return {tuple(words[i:i + span]) for i in range(len(words) - span + 1)}


def _text_of(item) -> str:
    return item["prompt"] if isinstance(item, dict) else str(item)


def _span_index(benchmark_prompts: Iterable, span: int) -> set[tuple[str, ...]]:
    index: set[tuple[str, ...]] = set()
    for b in benchmark_prompts:
        if isinstance(b, dict):
            for t in [b["prompt"], *b.get("turns", [])]:
                index |= word_spans(t, span)
        else:
            index |= word_spans(str(b), span)
    return index


def overlapping_prompts(train: Sequence, benchmark_prompts: Iterable, span: int = OVERLAP_SPAN) -> list:
    """The items of ``train`` that share any ``span``-word run with a benchmark prompt.

    Items of either sequence may be strings or prompt records (dicts with ``prompt``;
    a benchmark record's ``turns`` are checked too). Words are compared after
    lower-casing and stripping punctuation (``normalized_words``). The overlapping
    training items are returned unchanged, in their original order.
    """
    index = _span_index(benchmark_prompts, span)
    return [t for t in train if not index.isdisjoint(word_spans(_text_of(t), span))]


# --------------------------------------------------------------------------- word lists

TOPICS = [
    "photosynthesis", "the water cycle", "plate tectonics", "black holes", "the immune system",
    "compound interest", "inflation", "supply and demand", "the printing press", "the Silk Road",
    "the Roman aqueducts", "volcanoes", "coral reefs", "honeybee colonies", "migratory birds",
    "the human heart", "sleep and memory", "vaccines", "antibiotic resistance", "climate feedback loops",
    "solar panels", "wind turbines", "electric cars", "nuclear fission", "batteries",
    "the internet", "public-key encryption", "search engines", "machine translation", "GPS navigation",
    "the stock market", "insurance", "credit scores", "budgeting", "minimum wage debates",
    "the French Revolution", "the Industrial Revolution", "ancient Egyptian writing", "the Byzantine Empire",
    "the Apollo program", "the history of tea", "the invention of paper", "medieval castles",
    "Renaissance painting", "jazz improvisation", "the symphony orchestra", "film editing", "street photography",
    "urban gardening", "composting", "sourdough baking", "fermentation", "coffee roasting",
    "marathon training", "stretching", "strength training for beginners", "mindfulness", "habit formation",
    "time management", "public speaking", "negotiation", "remote work", "team retrospectives",
    "learning a second language", "speed reading", "note-taking methods", "spaced repetition", "critical thinking",
    "logical fallacies", "the scientific method", "statistics in the news", "probability in everyday life",
    "prime numbers", "the Fibonacci sequence", "fractals", "game theory", "the Monty Hall problem",
    "tides", "the seasons", "rainbows", "the northern lights", "earthquakes", "hurricanes",
    "deserts", "rainforests", "glaciers", "the deep ocean", "wetlands", "soil erosion",
    "recycling", "plastic pollution", "water treatment", "city planning", "public transport",
    "bridges", "skyscrapers", "elevators", "3D printing", "robot vacuum cleaners", "drones",
    "chess openings", "board game design", "video game storytelling", "origami", "knitting",
    "bird watching", "stargazing", "camping safety", "first aid basics", "food safety at home",
    "the history of the bicycle", "lighthouses", "canals", "railways", "ocean shipping containers",
    "libraries", "museums", "copyright", "open-source software", "online privacy", "password managers",
    "phishing scams", "cloud storage", "data backups", "spreadsheets", "email etiquette",
    "job interviews", "writing a resume", "starting a small business", "customer service", "product design",
    "color theory", "typography", "architecture styles", "interior lighting", "houseplants",
    "dog training", "cat behaviour", "keeping chickens", "beekeeping", "aquarium care",
    "volunteering", "community gardens", "local elections", "jury duty", "the census",
    "the metric system", "time zones", "calendars", "leap years", "measuring temperature",
]

AUDIENCES = [
    "a ten-year-old", "a curious teenager", "a first-year university student", "a busy parent",
    "a retired engineer", "someone who has never heard of it", "a new employee", "a visiting tourist",
    "a high-school class", "a skeptical friend", "an expert in a different field", "my grandmother",
    "a non-native English speaker", "a small-business owner",
]

FORMATS = [
    "Keep it under 150 words.", "Use three short paragraphs.", "Use a numbered list.",
    "Use bullet points.", "Include one everyday analogy.", "End with a one-line summary.",
    "Avoid jargon.", "Give one concrete example.", "Answer in five sentences.",
    "Start with a surprising fact.", "Add a short question to check understanding at the end.",
    "Write it as a short dialogue.", "",
]

COMPARE_PAIRS = [
    ("a laptop", "a tablet"), ("renting", "buying a home"), ("tea", "coffee"), ("trains", "planes for a 500 km trip"),
    ("e-books", "paper books"), ("cats", "dogs as pets"), ("running", "swimming"), ("a savings account", "an index fund"),
    ("SQL databases", "document databases"), ("Python", "JavaScript"), ("weather", "climate"), ("viruses", "bacteria"),
    ("speed", "velocity"), ("a democracy", "a monarchy"), ("wool", "cotton"), ("baking soda", "baking powder"),
    ("a crocodile", "an alligator"), ("a comet", "an asteroid"), ("a lake", "a reservoir"), ("mean", "median"),
    ("a will", "a trust"), ("leasing a car", "buying a car"), ("a podcast", "a radio show"), ("LED", "halogen bulbs"),
    ("hiking boots", "trail shoes"), ("a simile", "a metaphor"), ("an essay", "a report"), ("a virus scanner", "a firewall"),
    ("working from home", "working in an office"), ("a museum", "a gallery"), ("frogs", "toads"), ("jam", "marmalade"),
]

WRITING_FORMS = [
    "a short poem", "a haiku", "a limerick", "a six-sentence story", "a fable with a moral", "a diary entry",
    "a song chorus", "a postcard message", "a short speech", "a product description", "a riddle",
    "a bedtime story", "an opening paragraph for a mystery novel", "a two-line joke", "a motivational note",
]

SUBJECTS = [
    "a lighthouse keeper", "a lost umbrella", "the first snow of winter", "a robot learning to cook",
    "an old bicycle", "a city at dawn", "a cat who runs a bakery", "a train that never arrives",
    "a garden after rain", "a shy dragon", "moving to a new town", "the last day of school",
    "a message in a bottle", "a library at midnight", "a mountain hut", "a noisy neighbour",
    "a broken clock", "a street market", "a kite festival", "an astronaut's breakfast",
    "a friendship between a fox and a crow", "the smell of fresh bread", "a forgotten birthday",
    "a talking houseplant", "the sound of the sea", "a tiny island", "an elevator that talks",
]

TWISTS = [
    "", " told from the point of view of {character}", " set in {place}", " that ends with a surprise",
    " with a hopeful ending", " in the style of a news report", " using only short sentences",
]

CHARACTERS = ["a pigeon", "a grandmother", "a teacup", "a young detective", "a retired pirate", "a snowman", "a bus driver"]
PLACES = ["a desert town", "a floating city", "Victorian London", "a space station", "a fishing village", "a busy airport"]

SITUATIONS = [
    "keep procrastinating on a big assignment", "just moved to a city where I know nobody",
    "want to start running but get bored quickly", "have too many browser tabs and feel overwhelmed at work",
    "need to save money for a trip in six months", "find it hard to fall asleep before midnight",
    "have to give a presentation next week and I am nervous", "want to learn to cook simple healthy meals",
    "disagree with a coworker about how to run a project", "want to read more books this year",
    "keep forgetting people's names", "have a messy garage I never clean", "want to spend less time on my phone",
    "am choosing between two job offers", "need to study for an exam while working part time",
    "want my kids to help more around the house", "am planning my first solo trip abroad",
    "have a houseplant whose leaves keep turning yellow", "want to make friends at a new school",
    "am starting a vegetable garden on a small balcony", "need to ask my landlord for a repair",
]

GOALS = [
    "learning basic Spanish", "running a first 5 km race", "getting better at drawing", "organizing a small wedding",
    "moving house", "writing a short novel", "preparing for a job interview", "learning to touch type",
    "hosting a dinner party for eight", "reducing food waste at home", "learning the guitar",
    "starting a weekly newsletter", "training a puppy", "decluttering an apartment", "learning to swim as an adult",
]
DURATIONS = ["one-week", "two-week", "30-day", "three-month", "weekend", "daily 20-minute"]

PERSONAS = [
    "a patient museum guide", "a cheerful chemistry teacher", "a seasoned ship captain", "a friendly park ranger",
    "a careful pharmacist", "an enthusiastic astronomer", "a calm flight instructor", "a witty history professor",
    "a practical carpenter", "a travel agent who loves trains", "a helpful librarian", "a nutrition coach",
]
PERSONA_TASKS = [
    "Describe {topic} to a visitor in under 120 words.", "Answer a student who asks why {topic} matters.",
    "Give three fun facts about {topic}.", "Tell a short anecdote that teaches something about {topic}.",
    "Correct a common misconception about {topic}.",
]

RECIPIENTS = ["my manager", "a neighbour", "a hotel", "my landlord", "a customer", "a teacher", "a colleague", "a supplier"]
EMAIL_PURPOSES = [
    "asking to move a meeting to next week", "thanking them for their help last month",
    "apologising for a late delivery", "requesting a refund for a broken kettle", "asking for a day off on Friday",
    "confirming a booking for two nights", "following up on an unanswered question",
    "declining an invitation politely", "introducing a new team member", "reporting a noisy heating system",
]
TONES = ["friendly", "formal", "brief", "warm", "firm but polite"]

CHOICES = [
    "working a four-day week", "living without a car", "homeschooling", "learning to code as an adult",
    "buying a used phone", "adopting an older dog", "going vegetarian", "living in a small town",
    "taking a gap year", "using a standing desk", "shopping at farmers' markets", "owning a 3D printer",
]

IDEA_THINGS = [
    "a rainy Sunday with kids", "a science fair project", "a team-building activity", "a cheap date night",
    "a school fundraiser", "a blog about local history", "a birthday gift for a gardener", "a short film plot",
    "names for a bakery", "a neighbourhood clean-up day", "a board game theme", "healthy snacks for work",
]

PHENOMENA = [
    "the sky look blue", "ice float on water", "bread go stale", "metal feel colder than wood",
    "the moon show phases", "onions make people cry", "popcorn pop", "a compass point north",
    "soap remove grease", "leaves change colour in autumn", "we get hiccups", "cats purr",
    "salt melt ice on roads", "a balloon stick to a wall after rubbing", "thunder follow lightning",
]

# ---- code word lists

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++"]

CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome, ignoring case and spaces",
    "counts how often each character appears in a string", "returns the n-th Fibonacci number iteratively",
    "finds the two numbers in a list that add up to a target", "merges two sorted lists into one sorted list",
    "removes duplicate values from a list while keeping their order", "flattens a nested list of any depth",
    "rotates a matrix by 90 degrees clockwise", "converts a Roman numeral to an integer",
    "converts an integer to its English words", "checks whether brackets in a string are balanced",
    "computes the greatest common divisor of two integers", "tests whether a number is prime",
    "lists all primes below n with a sieve", "groups words that are anagrams of each other",
    "finds the longest common prefix of a list of strings", "performs binary search on a sorted list",
    "computes a running median of a stream of numbers", "splits a list into chunks of size k",
    "validates an email address with simple rules", "parses a query string into a dictionary",
    "formats a number of seconds as HH:MM:SS", "computes the Levenshtein distance between two words",
    "finds the most frequent word in a text file", "returns the transpose of a matrix",
    "computes the moving average of a list with a given window", "implements run-length encoding",
    "decodes a run-length encoded string", "finds all permutations of a short string",
    "generates all subsets of a set", "checks whether two rectangles overlap",
    "computes the area of a polygon from its vertices", "converts Celsius to Fahrenheit and back",
    "shuffles a list in place with the Fisher-Yates algorithm", "finds the k largest elements of a list",
    "counts the islands in a grid of 0s and 1s", "detects a cycle in a linked list",
    "reverses a singly linked list", "checks whether a binary tree is balanced",
    "returns the level-order traversal of a binary tree", "finds the shortest path in an unweighted graph",
    "topologically sorts tasks with dependencies", "implements an LRU cache",
    "parses a CSV line that may contain quoted commas", "pretty-prints a nested dictionary",
    "computes the day of the week for a given date", "checks whether a year is a leap year",
    "truncates text to n characters without cutting words", "wraps text to a given line width",
    "converts snake_case names to camelCase", "counts vowels and consonants in a string",
    "finds the missing number in a list containing 1 to n", "computes the power set size and lists it",
    "returns the intersection of two lists without duplicates", "sums the digits of an integer",
    "checks whether a number is an Armstrong number", "generates Pascal's triangle up to n rows",
    "evaluates a postfix arithmetic expression", "tokenizes a simple arithmetic expression",
    "compresses consecutive spaces in a string", "finds the longest increasing subsequence",
    "solves the coin change problem with the fewest coins", "computes the maximum subarray sum",
    "validates a Sudoku board", "simulates rolling two dice many times and reports frequencies",
    "reads a log file and counts lines per severity level", "retries a function call with exponential backoff",
    "memoizes a slow recursive function", "computes the median of two sorted lists",
    "converts a hex colour code to RGB values", "masks all but the last four digits of a card number",
]
CODE_CONSTRAINTS = [
    "Include a short docstring.", "Add two example calls.", "Do not use recursion.", "Keep it under 20 lines.",
    "Explain the time complexity afterwards.", "Handle empty input gracefully.", "Add comments on the tricky parts.",
    "Use only the standard library.", "",
]

CONCEPTS = [
    "closures", "generators", "decorators", "context managers", "list comprehensions", "recursion",
    "exceptions", "interfaces", "immutability", "hash maps", "iterators", "async/await", "unit testing",
    "dependency injection", "pattern matching", "type inference", "garbage collection", "pointers",
    "higher-order functions", "enumerations", "string formatting", "regular expressions", "threads",
    "mutexes", "queues", "variable scope", "inheritance", "composition over inheritance", "lazy evaluation",
]

DATA_STRUCTURES = [
    ("Stack", ["push", "pop", "peek", "is_empty"]), ("Queue", ["enqueue", "dequeue", "size"]),
    ("MinHeap", ["insert", "pop_min", "peek"]), ("Trie", ["insert", "contains", "starts_with"]),
    ("BankAccount", ["deposit", "withdraw", "balance"]), ("TodoList", ["add", "complete", "pending"]),
    ("Matrix", ["add", "multiply", "transpose"]), ("Vector2D", ["add", "scale", "length"]),
    ("RingBuffer", ["append", "get", "is_full"]), ("Graph", ["add_edge", "neighbors", "has_path"]),
    ("Library", ["add_book", "lend", "return_book"]), ("Thermostat", ["set_target", "read", "heating_on"]),
]

SQL_TABLES = [
    ("orders", "id, customer_id, total, created_at"), ("employees", "id, name, department, salary, hired_on"),
    ("books", "id, title, author, year, copies"), ("flights", "id, origin, destination, departs_at, seats_free"),
    ("students", "id, name, grade, school_id"), ("sensor_readings", "sensor_id, recorded_at, temperature"),
]
SQL_TASKS = [
    "returns the five largest rows by the numeric column", "counts rows per day", "finds duplicate values in the second column",
    "computes an average per group of the third column", "returns rows created in the last 30 days",
    "lists groups with more than ten rows", "finds the row with the highest value in each group",
]

SHELL_TASKS = [
    "finds the ten largest files under a directory", "counts lines in all .py files in a project",
    "renames every .jpeg file to .jpg", "shows which process is listening on port 8080",
    "deletes log files older than 14 days", "prints the disk usage of each subfolder, sorted",
    "extracts every email address from a text file", "compresses a folder into a dated tar.gz archive",
]

# ---- math word lists

NAMES = [
    "Ava", "Ben", "Chloe", "Dmitri", "Esi", "Farah", "Gus", "Hiro", "Ines", "Jamal", "Kira", "Luca", "Maya",
    "Nils", "Olu", "Paz", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe",
]
ITEMS = [
    ("apples", "bag"), ("pencils", "box"), ("stickers", "sheet"), ("cookies", "tin"), ("marbles", "jar"),
    ("eggs", "carton"), ("cupcakes", "tray"), ("crayons", "pack"), ("buttons", "card"), ("tomatoes", "crate"),
    ("postcards", "set"), ("candles", "pack"), ("muffins", "basket"), ("seashells", "pail"),
]
UNIT_ITEMS = ["notebook", "sandwich", "ticket", "plant", "scarf", "puzzle", "mug", "kite", "lamp", "book"]


# --------------------------------------------------------------------------- stdlib material

STDLIB_MODULES = (
    "string", "itertools", "collections", "json", "re", "os.path", "textwrap", "statistics", "datetime",
    "math", "functools", "heapq", "bisect", "random", "fractions", "decimal", "difflib", "shlex",
    "urllib.parse", "pathlib", "csv", "base64", "hashlib", "zlib", "calendar", "copy", "operator", "html",
    "ipaddress", "uuid", "secrets", "fnmatch", "glob", "shutil", "tempfile", "time", "unicodedata", "io",
    "contextlib", "struct", "enum", "dataclasses", "builtins", "cmath", "graphlib", "zipfile", "gzip",
    "email.utils", "http.cookies", "pprint", "reprlib", "keyword", "colorsys", "wave", "locale",
)
# classes whose public methods become tasks too: (module, class name, display prefix)
STDLIB_CLASSES = (
    ("builtins", "str", "str"), ("builtins", "list", "list"), ("builtins", "dict", "dict"),
    ("builtins", "set", "set"), ("builtins", "bytes", "bytes"), ("builtins", "int", "int"),
    ("collections", "Counter", "collections.Counter"), ("collections", "deque", "collections.deque"),
    ("collections", "OrderedDict", "collections.OrderedDict"), ("datetime", "date", "datetime.date"),
    ("datetime", "datetime", "datetime.datetime"), ("datetime", "timedelta", "datetime.timedelta"),
    ("pathlib", "Path", "pathlib.Path"), ("fractions", "Fraction", "fractions.Fraction"),
    ("decimal", "Decimal", "decimal.Decimal"), ("difflib", "SequenceMatcher", "difflib.SequenceMatcher"),
    ("textwrap", "TextWrapper", "textwrap.TextWrapper"), ("random", "Random", "random.Random"),
    ("statistics", "NormalDist", "statistics.NormalDist"), ("ipaddress", "IPv4Network", "ipaddress.IPv4Network"),
)


@dataclass(frozen=True)
class StdlibEntry:
    """One documented stdlib callable: its dotted name, signature text and first doc sentence."""

    qualname: str  # e.g. "textwrap.shorten" or "str.removeprefix"
    name: str  # the bare name, e.g. "shorten"
    signature: str  # "(text, width, **kwargs)" or "" when unknown
    summary: str  # first sentence of the docstring


_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def _summary(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0]
    if ">>>" in para or para.startswith(("Deprecated", "deprecated")):
        return None
    para = " ".join(para.split())
    for abbr in _ABBREVIATIONS:  # do not end a sentence inside "e.g." and friends
        para = para.replace(abbr, abbr.replace(".", "\0"))
    sentence = _SENTENCE_END.split(para, maxsplit=1)[0].strip().replace("\0", ".")
    sentence = re.sub(r"\.{2,}$", ".", sentence)
    words = sentence.split()
    if not (4 <= len(words) <= 40) or not sentence[0].isupper():
        return None
    if re.match(r"^[\w.]+\(", sentence) or "deprecated" in sentence.lower():
        return None
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _entry(qualname: str, obj, method: bool = False) -> StdlibEntry | None:
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return None
    doc = inspect.getdoc(obj)
    summary = _summary(doc) if doc else None
    if summary is None:
        return None
    sig = _signature(obj)
    if method:
        sig = re.sub(r"^\(self(, /)?(, )?", "(", sig)
    return StdlibEntry(qualname, qualname.rsplit(".", 1)[-1], sig, summary)


@functools.lru_cache(maxsize=1)
def stdlib_entries() -> tuple[StdlibEntry, ...]:
    """Documented public callables of STDLIB_MODULES and methods of STDLIB_CLASSES, sorted by name."""
    found: dict[str, StdlibEntry] = {}
    for modname in STDLIB_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        prefix = "" if modname == "builtins" else modname + "."
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if obj is None or not callable(obj) or inspect.ismodule(obj):
                continue
            e = _entry(prefix + name, obj)
            if e is not None:
                found.setdefault(e.qualname, e)
    for modname, clsname, display in STDLIB_CLASSES:
        try:
            cls = getattr(importlib.import_module(modname), clsname)
        except (ImportError, AttributeError):
            continue
        for name in sorted(vars(cls)):
            if name.startswith("_"):
                continue
            obj = getattr(cls, name, None)
            if obj is None or not callable(obj):
                continue
            e = _entry(f"{display}.{name}", obj, method=True)
            if e is not None:
                found.setdefault(e.qualname, e)
    return tuple(found[k] for k in sorted(found))


# --------------------------------------------------------------------------- generators

Gen = Callable[[random.Random], str]


def _fill(rng: random.Random, template: str) -> str:
    return template.format(character=rng.choice(CHARACTERS), place=rng.choice(PLACES))


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _chat_explain(rng):
    lead = rng.choice(["Explain {t} to {a}.", "Describe {t} for {a}.", "Give {a} an overview of {t}.",
                       "Walk {a} through {t}.", "Teach {a} the basics of {t}."])
    return _join(lead.format(t=rng.choice(TOPICS), a=rng.choice(AUDIENCES)), rng.choice(FORMATS))


def _chat_compare(rng):
    a, b = rng.choice(COMPARE_PAIRS)
    if rng.random() < 0.5:
        a, b = b, a
    lead = rng.choice([
        "What are the main differences between {a} and {b}?", "Compare {a} and {b}.",
        "How do {a} and {b} differ, and when would you pick each?", "Is {a} better than {b}? Argue both sides.",
    ])
    return _join(lead.format(a=a, b=b), rng.choice(FORMATS))


def _chat_creative(rng):
    form, subject = rng.choice(WRITING_FORMS), rng.choice(SUBJECTS)
    twist = _fill(rng, rng.choice(TWISTS))
    verb = rng.choice(["Write", "Compose", "Create", "Draft"])
    return f"{verb} {form} about {subject}{twist}."


def _chat_advice(rng):
    n = rng.choice(["three", "four", "five", "a few"])
    return _join(f"I {rng.choice(SITUATIONS)}.",
                 rng.choice([f"What should I do? Give me {n} practical tips.", "Any advice?",
                             f"Suggest {n} small steps I can start today.", "How would you approach this?"]))


def _chat_plan(rng):
    return _join(f"Make a {rng.choice(DURATIONS)} plan for {rng.choice(GOALS)}.",
                 rng.choice(["Keep it realistic for a beginner.", "Use a table with one row per step.",
                             "List what I need before starting.", "", "Mention common mistakes to avoid."]))


def _chat_persona(rng):
    task = rng.choice(PERSONA_TASKS).format(topic=rng.choice(TOPICS))
    return f"You are {rng.choice(PERSONAS)}. {task}"


def _chat_email(rng):
    return _join(f"Write a {rng.choice(TONES)} email to {rng.choice(RECIPIENTS)} {rng.choice(EMAIL_PURPOSES)}.",
                 rng.choice(["", "Keep it under 100 words.", "Include a subject line.", "Sign it as Sam."]))


def _chat_opinion(rng):
    c = rng.choice(CHOICES)
    return rng.choice([
        f"List the pros and cons of {c}.", f"What should someone consider before {c}?",
        f"Write a balanced paragraph about {c}.", f"Give three arguments for and three against {c}.",
    ])


def _chat_ideas(rng):
    return _join(f"Give me {rng.choice(['five', 'seven', 'ten', 'six'])} ideas for {rng.choice(IDEA_THINGS)}.",
                 rng.choice(["", "Keep each to one line.", "Make them cheap.", "Sort them from easiest to hardest."]))


def _chat_why(rng):
    return _join(f"Why does {rng.choice(PHENOMENA)}?",
                 rng.choice(["Explain it simply.", f"Explain it to {rng.choice(AUDIENCES)}.",
                             "Give the short answer first, then the details.", ""]))


def _chat_quiz(rng):
    n = rng.choice([3, 4, 5])
    return _join(f"Write a {n}-question multiple-choice quiz about {rng.choice(TOPICS)}.",
                 rng.choice(["Mark the correct answers.", "Put the answers at the end.", ""]))


CHAT_GENERATORS: list[tuple[Gen, float]] = [
    (_chat_explain, 3), (_chat_compare, 1.5), (_chat_creative, 2), (_chat_advice, 1.5), (_chat_plan, 1),
    (_chat_persona, 1.5), (_chat_email, 1), (_chat_opinion, 1), (_chat_ideas, 1), (_chat_why, 1), (_chat_quiz, 1),
]


def _code_stdlib(rng):
    e = rng.choice(stdlib_entries())
    sig = f"{e.qualname}{e.signature}" if e.signature else e.qualname
    mod = e.qualname.rsplit(".", 1)[0] if "." in e.qualname else "the builtins"
    templates = [
        f"Write a Python function named `my_{e.name}` with this behaviour: {e.summary} "
        f"Do not call `{e.qualname}` itself.",
        f"Explain what `{sig}` does and give a short example of using it.",
        f"The Python docs describe `{e.qualname}` as: \"{e.summary}\" Show a realistic use of it in a few lines of code.",
        f"Write two pytest tests for `{e.qualname}`: one typical call and one edge case.",
        f"When would you reach for `{e.qualname}` instead of writing the logic by hand? Give an example.",
        f"Implement a simplified version of `{e.qualname}` in plain Python. Its documentation says: {e.summary}",
        f"What are the parameters of `{sig}`, and what does each one control?",
    ]
    if mod != "the builtins" and not mod.startswith(("str", "list", "dict", "set", "bytes", "int")):
        templates.append(f"Name two other functions in `{mod}` that are often used together with `{e.name}`, "
                         "and show them in one example.")
    return rng.choice(templates)


def _code_task(rng):
    return _join(f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}.",
                 rng.choice(CODE_CONSTRAINTS))


def _code_concept(rng):
    lang = rng.choice(LANGUAGES)
    return rng.choice([
        f"Explain {rng.choice(CONCEPTS)} in {lang} with a short code example.",
        f"What are common mistakes with {rng.choice(CONCEPTS)} in {lang}? Show one bad and one fixed snippet.",
        f"How would you teach {rng.choice(CONCEPTS)} to a {lang} beginner? Include a tiny exercise.",
    ])


def _code_class(rng):
    cls, methods = rng.choice(DATA_STRUCTURES)
    lang = rng.choice(["Python", "Python", "Java", "TypeScript", "C++", "Rust", "Go"])
    ms = ", ".join(f"`{m}`" for m in methods)
    return _join(f"Implement a `{cls}` class in {lang} with the methods {ms}.",
                 rng.choice(["Add a short usage example.", "Raise an error on invalid operations.", ""]))


def _code_sql(rng):
    table, cols = rng.choice(SQL_TABLES)
    return f"Given a table `{table}({cols})`, write a SQL query that {rng.choice(SQL_TASKS)}. Explain it briefly."


def _code_shell(rng):
    return _join(f"Write a {rng.choice(['bash', 'shell', 'PowerShell'])} command that {rng.choice(SHELL_TASKS)}.",
                 rng.choice(["Explain each part.", "", "Make it safe to run twice."]))


_SNIPPET_BUGS = [
    ("def total(xs):\n    s = 0\n    for i in range(1, len(xs)):\n        s += xs[i]\n    return s", "skips the first item"),
    ("def last_n(xs, n):\n    return xs[-n:]", "is wrong when n is 0"),
    ("def average(xs):\n    return sum(xs) / len(xs)", "crashes on an empty list"),
    ("def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket", "shares state between calls"),
    ("def is_even(n):\n    return n % 2 == 1", "returns the opposite answer"),
    ("def find(xs, target):\n    for i, x in enumerate(xs):\n        if x == target:\n            return i\n        return -1",
     "only ever checks the first element"),
]


def _code_review(rng):
    code, hint = rng.choice(_SNIPPET_BUGS)
    name = rng.choice(["values", "items", "data", "nums", "entries"])
    code = code.replace("xs", name)
    return rng.choice([
        f"This Python function {hint}. Explain why and fix it:\n```python\n{code}\n```",
        f"Review this code and point out any problems:\n```python\n{code}\n```",
        f"Add type hints and a docstring to this function:\n```python\n{code}\n```",
    ])


CODE_GENERATORS: list[tuple[Gen, float]] = [
    (_code_stdlib, 5), (_code_task, 3), (_code_concept, 1), (_code_class, 1), (_code_sql, 0.6),
    (_code_shell, 0.4), (_code_review, 0.6),
]

MATH_WRAPPERS = [
    "Show your working.", "Explain each step.", "Solve it step by step.", "Work it out carefully, one step at a time.",
    "Give the answer and explain how you got it.", "Show the calculation.",
]


def _money(rng, lo, hi):
    return f"{rng.randint(lo * 4, hi * 4) / 4:.2f}"


def _m_buy(rng):
    name, item = rng.choice(NAMES), rng.choice(UNIT_ITEMS)
    k, price = rng.randint(2, 9), _money(rng, 1, 20)
    pay = (int(k * float(price)) // 10 + 1) * 10 + rng.choice([0, 10, 20])
    return f"{name} buys {k} {item}s at ${price} each and pays with ${pay}. How much change does {name} get?"


def _m_pack(rng):
    name, (thing, box) = rng.choice(NAMES), rng.choice(ITEMS)
    per, boxes, extra = rng.randint(4, 24), rng.randint(3, 15), rng.randint(1, 30)
    return (f"{name} has {boxes} {box}s of {thing} with {per} in each {box}, plus {extra} loose {thing}. "
            f"How many {thing} does {name} have in total?")


def _m_share(rng):
    (thing, _), people = rng.choice(ITEMS), rng.randint(2, 9)
    each = rng.randint(3, 25)
    left = rng.randint(0, people - 1)
    total = people * each + left
    return (f"{total} {thing} are shared equally among {people} friends. "
            f"How many does each friend get, and how many are left over?")


def _m_speed(rng):
    name = rng.choice(NAMES)
    v, h = rng.choice([4, 5, 12, 15, 18, 40, 60, 75, 90]), rng.choice([0.5, 1.5, 2, 2.5, 3, 4])
    vehicle = {4: "walks", 5: "walks", 12: "cycles", 15: "cycles", 18: "cycles"}.get(v, "drives")
    return f"{name} {vehicle} at {v} km per hour for {h} hours. How far does {name} travel?"


def _m_percent(rng):
    p, base = rng.choice([5, 10, 12, 15, 20, 25, 30, 40]), rng.randint(4, 60) * 5
    item = rng.choice(UNIT_ITEMS)
    return rng.choice([
        f"A {item} costs ${base}. It is on sale for {p}% off. What is the sale price?",
        f"A town of {base * 100} people grows by {p}% in a year. How many people live there after the year?",
        f"What is {p}% of {base}?",
    ])


def _m_area(rng):
    a, b = rng.randint(3, 30), rng.randint(3, 30)
    return rng.choice([
        f"A rectangular room is {a} m long and {b} m wide. What is its area and its perimeter?",
        f"A fence goes around a field {a} m by {b} m, with a post every {rng.choice([1, 2, 3])} m. How many posts are needed?",
        f"How many square tiles of side 50 cm cover a floor of {a} m by {b} m?",
    ])


def _m_age(rng):
    n1, n2 = rng.sample(NAMES, 2)
    d, s = rng.randint(2, 12), rng.randint(3, 20)
    return f"{n1} is {d} years older than {n2}. In {s} years their ages will add up to {2 * rng.randint(20, 45) + d}. How old is {n2} now?"


def _m_average(rng):
    scores = [rng.randint(50, 100) for _ in range(rng.randint(3, 6))]
    return f"The scores in a quiz were {', '.join(map(str, scores))}. What is the mean score, and what is the median?"


def _m_time(rng):
    h, m = rng.randint(6, 11), rng.choice([0, 10, 15, 20, 35, 45, 50])
    dur_h, dur_m = rng.randint(1, 5), rng.choice([5, 15, 25, 30, 40, 55])
    event = rng.choice(["A bus ride", "A concert", "A football match", "A cooking class", "A ferry trip"])
    return f"{event} starts at {h}:{m:02d} and lasts {dur_h} hours and {dur_m} minutes. At what time does it end?"


def _m_equation(rng):
    a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(-30, 30)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}."


def _m_fraction(rng):
    p, q = rng.randint(1, 5), rng.randint(6, 12)
    r, s = rng.randint(1, 5), rng.randint(2, 9)
    return rng.choice([
        f"Add the fractions {p}/{q} and {r}/{s} and simplify the result.",
        f"Multiply {p}/{q} by {r}/{s} and simplify.",
        f"A pizza is cut into {q} slices and {rng.choice(NAMES)} eats {p}. What fraction is left?",
    ])


def _m_rate(rng):
    name = rng.choice(NAMES)
    per_h, hours, days = rng.randint(9, 40), rng.randint(2, 8), rng.randint(2, 6)
    return f"{name} earns ${per_h} an hour and works {hours} hours a day for {days} days. How much does {name} earn?"


def _m_ratio(rng):
    a, b, k = rng.randint(1, 5), rng.randint(1, 5), rng.randint(2, 12)
    x, y = rng.sample(["red", "blue", "green", "yellow", "white"], 2)
    return f"A bag holds {x} and {y} balls in the ratio {a}:{b}. There are {a * k + b * k} balls. How many are {x}?"


def _m_arith(rng):
    a, b = rng.randint(12, 999), rng.randint(12, 99)
    op = rng.choice([f"{a} × {b}", f"{a * b} ÷ {b}", f"{a} + {b} × {rng.randint(2, 9)}", f"({a} - {b}) × {rng.randint(2, 9)}"])
    return f"Calculate {op}."


def _m_convert(rng):
    v = rng.randint(2, 90)
    return rng.choice([
        f"How many minutes are there in {v} hours and {rng.randint(1, 59)} minutes?",
        f"Convert {v * 250} grams to kilograms.", f"How many centimeters are in {v}.{rng.randint(1, 9)} meters?",
        f"A recipe for 4 people needs {v * 10} g of rice. How much rice is needed for {rng.randint(5, 12)} people?",
    ])


def _m_prob(rng):
    r, b = rng.randint(1, 9), rng.randint(1, 9)
    return rng.choice([
        f"A box has {r} red and {b} blue counters. One is picked at random. What is the probability it is red?",
        f"Two fair dice are rolled. What is the probability that the total is {rng.randint(2, 12)}?",
        f"A coin is tossed {rng.randint(2, 4)} times. What is the probability of getting only heads?",
    ])


MATH_GENERATORS: list[tuple[Gen, float]] = [
    (_m_buy, 1), (_m_pack, 1), (_m_share, 1), (_m_speed, 1), (_m_percent, 1), (_m_area, 1), (_m_age, 0.6),
    (_m_average, 0.8), (_m_time, 0.8), (_m_equation, 1), (_m_fraction, 1), (_m_rate, 0.8), (_m_ratio, 0.7),
    (_m_arith, 0.8), (_m_convert, 0.8), (_m_prob, 0.8),
]


def _math_prompt(rng):
    gen = _pick(rng, MATH_GENERATORS)
    return f"{gen(rng)} {rng.choice(MATH_WRAPPERS)}"


def _pick(rng: random.Random, table: list[tuple[Gen, float]]) -> Gen:
    return rng.choices([g for g, _ in table], weights=[w for _, w in table])[0]


_KIND_GEN: dict[str, Gen] = {
    "chat": lambda rng: _pick(rng, CHAT_GENERATORS)(rng),
    "code": lambda rng: _pick(rng, CODE_GENERATORS)(rng),
    "math": _math_prompt,
}


# --------------------------------------------------------------------------- public API


def _quotas(n: int, mix: dict[str, float]) -> dict[str, int]:
    total = sum(mix.values())
    raw = {k: n * mix[k] / total for k in mix}
    q = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - q[k], reverse=True)[: n - sum(q.values())]:
        q[k] += 1
    return q


def default_benchmark_texts() -> list[str]:
    """The benchmark prompts training must avoid: every set ``bench.datasets`` can load.

    MT-Bench and HumanEval are skipped when their packages are missing; the project's
    math and repeat sets are always included.
    """
    from bench.datasets import benchmark_texts

    return benchmark_texts()


def training_prompts(
    n: int = 5000,
    seed: int = 0,
    benchmark: Iterable | None = None,
    mix: dict[str, float] | None = None,
) -> list[dict]:
    """``n`` distinct drafter-training prompts: dicts with ``id``, ``kind`` and ``prompt``.

    Kinds follow ``mix`` (default DEFAULT_MIX: 45 % chat, 35 % code, 20 % math),
    shuffled together. Deterministic for a given ``seed``. Prompts sharing an
    OVERLAP_SPAN-word span with ``benchmark`` (strings or prompt records; default
    ``default_benchmark_texts()``) are dropped and replaced. Raises RuntimeError if
    the generators cannot produce enough distinct prompts.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds in mix: {sorted(unknown)}; expected {KINDS}")
    index = _span_index(default_benchmark_texts() if benchmark is None else benchmark, OVERLAP_SPAN)
    seen: set[str] = set()
    rows: list[dict] = []
    for kind, quota in _quotas(n, mix).items():
        rng = random.Random(f"bastion-prompts:{seed}:{kind}")
        made, tries = 0, 0
        while made < quota:
            tries += 1
            if tries > 50 * quota + 1000:
                raise RuntimeError(f"could only make {made} of {quota} distinct {kind} prompts")
            prompt = _KIND_GEN[kind](rng).strip()
            key = " ".join(normalized_words(prompt))
            if key in seen or not index.isdisjoint(word_spans(prompt, OVERLAP_SPAN)):
                continue
            seen.add(key)
            rows.append({"kind": kind, "prompt": prompt})
            made += 1
    random.Random(f"bastion-prompts:{seed}:order").shuffle(rows)
    return [{"id": f"train/{i:05d}", **r} for i, r in enumerate(rows)]
