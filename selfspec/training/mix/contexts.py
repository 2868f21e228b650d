"""Prompts with real contexts, built offline: what users send when they paste something and ask about it.

Every builder returns `Prompt`s: the user turns (a multi-turn prompt alternates user and assistant text and
ends with a user turn), the source and template they came from, and a `group` naming the text they were
made from (a document, a package, a function, a catalogue entry), so that a held-out split can keep a whole
group on one side. Builders are pure: text in, prompts out, randomness from the `random.Random` passed in.

Sources of context, all on the machine or written by the target itself:
- documents      two stages: the target writes an article, story, email, ... about a seed topic
                 (`writing_requests`), then templated requests ask to summarise it, answer from it, continue
                 it, rewrite it or translate a part of it (`document_requests`)
- package_docs   installed Python packages' descriptions (METADATA: summary and README), as documents to
                 summarise or answer from, and several summaries as passages for a retrieval-style question
- code           functions from installed Python source (the standard library and site-packages): explain,
                 document, test, fix (a mutated copy), refactor, port, or write it from its docstring
- translation    sentence pairs from the gettext catalogues (catalogs.py), in both directions
- followups      a second user turn after the target's first answer (`followup_prompts`)
The templates below are original text of this project.
"""

from __future__ import annotations

import ast
import glob
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.training.mix.catalogs import LANGUAGES, TranslationPair


@dataclass(frozen=True)
class Prompt:
    turns: tuple[str, ...]  # user, (assistant, user)*: the target answers the last user turn
    source: str  # magpie | files | documents | writing | package_docs | code | translation | multiturn
    kind: str  # the template, e.g. "summarize"
    group: str  # the text it was made from
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # builder details (a document's topic, ...)

    @property
    def text(self) -> str:
        return self.turns[-1]

    def messages(self) -> list[dict]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(self.turns)]

    def to_json(self) -> dict:
        return {"turns": list(self.turns), "source": self.source, "kind": self.kind, "group": self.group, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "Prompt":
        return cls(tuple(d["turns"]), d["source"], d["kind"], d["group"], dict(d.get("meta") or {}))


def clip(text: str, max_chars: int) -> str:
    """`text` cut to at most max_chars at a paragraph (else sentence, else word) boundary."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    for sep in ("\n\n", ". ", "\n", " "):
        at = cut.rfind(sep)
        if at >= max_chars // 2:
            return cut[: at + (1 if sep == ". " else 0)].strip()
    return cut.strip()


def _pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


# ====================================================================================== documents (two stages)
TOPICS = (
    "a small town that bans cars from its centre", "the first day at a new job", "how honeybees communicate",
    "a bakery that opens at 4 a.m.", "saving money on groceries", "the history of the bicycle",
    "a lost dog that finds its way home", "remote work and loneliness", "learning a language as an adult",
    "the water cycle", "a chess tournament in a school", "recycling plastic", "a power outage in a big city",
    "volcanoes", "a new public library", "training for a first marathon", "how vaccines work",
    "a family road trip", "the invention of the printing press", "urban gardening", "a robot that learns to paint",
    "the benefits of sleep", "a museum heist", "climate change and coffee farming", "a lighthouse keeper",
    "how credit scores work", "the moon landing", "a startup that fails", "composting at home",
    "the rules of basketball", "a storm at sea", "how to prepare for a job interview", "the Roman aqueducts",
    "a village festival", "electric cars", "a teacher who changes a student's life", "how the internet works",
    "deep sea creatures", "a cooking competition", "the importance of bees for farming", "a time traveller",
    "a software bug that stops a train network", "the life of a street musician", "solar panels on rooftops",
    "a mountain rescue", "the history of chocolate", "a neighbourhood dispute about a tree",
    "how to learn to code", "the Great Barrier Reef", "a scientist's surprising discovery", "minimalism",
    "an old photograph found in an attic", "public transport in rural areas", "the human heart",
    "a friendship between two rivals", "the stock market for beginners", "wildfires", "a night at the observatory",
    "the origins of the Olympic Games", "a delayed flight", "pollinators in cities", "writing a first novel",
    "the tallest buildings in the world", "a farmer's market", "artificial intelligence in hospitals",
    "a haunted house that is not haunted", "how to care for houseplants", "the silk road", "a new school rule",
    "a kayak trip", "the discovery of penicillin", "noise in cities", "a wedding that goes wrong",
    "how elections are organised", "a small business going online", "migrating birds", "the history of jazz",
    "a community that builds a playground", "water shortages", "a detective who hates puzzles",
    "the first computers", "healthy breakfasts", "an island without internet", "glaciers melting",
    "a football club's comeback", "how bread is made", "a letter that arrives fifty years late",
    "the pyramids of Giza", "a city's plan to plant a million trees", "online privacy", "a ski resort without snow",
    "the life cycle of a star", "a retired engineer who builds a boat", "how to give feedback at work",
    "a spelling bee", "the history of the telephone", "a flood in a river town", "a year without buying clothes",
    "a space station", "the benefits of walking", "a strike at a factory", "how earthquakes happen",
)

GENRES = (
    ("news", "Write a short news article about {topic}."),
    ("news", "Write a news report, about 200 words, on {topic}."),
    ("story", "Write a short story about {topic}."),
    ("story", "Tell me a story about {topic}, in about three paragraphs."),
    ("email", "Write an email to my team about {topic}."),
    ("email", "Write a polite email to a customer explaining a delay related to {topic}."),
    ("blog", "Write a blog post about {topic}."),
    ("essay", "Write a short essay on {topic}."),
    ("encyclopedia", "Write an encyclopedia-style entry about {topic}."),
    ("report", "Write a short report for a city council about {topic}."),
    ("speech", "Write a short speech about {topic}."),
    ("letter", "Write a letter to the editor of a local newspaper about {topic}."),
    ("notes", "Write meeting notes from a discussion about {topic}."),
    ("review", "Write a review of a documentary about {topic}."),
    ("code", "Write a Python module with a few functions for an app about {topic}."),
)

_DOC_NAMES = {"news": "article", "story": "story", "email": "email", "blog": "blog post", "essay": "essay",
              "encyclopedia": "text", "report": "report", "speech": "speech", "letter": "letter",
              "notes": "notes", "review": "review", "code": "code"}


def writing_requests(rng: random.Random, n: int, start: int = 0) -> list[Prompt]:
    """n requests for a document about a seed topic (stage one of the documents source), groups doc:<i>."""
    out = []
    for i in range(start, start + n):
        genre, template = _pick(rng, GENRES)
        topic = _pick(rng, TOPICS)
        out.append(Prompt((template.format(topic=topic),), "writing", genre, f"doc:{i}", {"topic": topic, "genre": genre}))
    return out


_SUMMARIZE = (
    "Summarize the following {doc} in a few sentences.\n\n{text}",
    "{text}\n\nSummarize the {doc} above in three sentences.",
    "Give me a one-paragraph summary of this {doc}:\n\n{text}",
    "TL;DR of this {doc}, please:\n\n{text}",
    "Read the {doc} below and list its key points as bullets.\n\n{text}",
)
_ANSWER = (
    "{text}\n\nBased on the {doc} above, what does it say about {entity}?",
    "Here is a {doc}:\n\n{text}\n\nQuestion: What is the main point of this {doc}?",
    "{text}\n\nAnswer using only the text above: who or what is {entity}, and what role does it play?",
    "Context:\n{text}\n\nQuestion: Which facts about {entity} does the context give?",
    "{text}\n\nAccording to the {doc}, what happened, and why does it matter?",
)
_CONTINUE = (
    "Continue this {doc}:\n\n{half}",
    "Here is the beginning of a {doc}. Write the rest.\n\n{half}",
)
_REWRITE = (
    "Rewrite this {doc} in a more formal tone:\n\n{text}",
    "Make this {doc} shorter and clearer:\n\n{text}",
    "Fix any grammar and spelling mistakes in the following text and return the corrected version.\n\n{text}",
    "Write a good title for this {doc}:\n\n{text}",
    "Rewrite the following {doc} for a ten-year-old:\n\n{text}",
)
_TRANSLATE_PART = (
    "Translate the following paragraph into {language}:\n\n{part}",
    "Please translate this into {language}.\n\n{part}",
)
_CODE_DOC = (
    "Explain what this code does:\n\n{text}",
    "Add comments to this code:\n\n{text}",
    "Review this code and suggest improvements.\n\n{text}",
    "Write unit tests for this code.\n\n{text}",
)
DOCUMENT_KINDS = ("summarize", "answer", "continue", "rewrite", "translate")


def _entity(rng: random.Random, text: str, fallback: str) -> str:
    """A name the text mentions (capitalised words not starting a sentence), else the fallback topic."""
    names = re.findall(r"(?<=[a-z,;] )([A-Z][a-z]+(?: [A-Z][a-z]+)*)", text)
    names = [n for n in dict.fromkeys(names) if len(n) > 3]
    return _pick(rng, names) if names else fallback


def document_requests(rng: random.Random, document: str, writing: Prompt, n: int, max_chars: int) -> list[Prompt]:
    """n requests about a document the target wrote for `writing` (distinct kinds while they last)."""
    genre = writing.meta.get("genre", "text")
    topic = writing.meta.get("topic", "the topic")
    doc = _DOC_NAMES.get(genre, "text")
    text = clip(document, max_chars)
    paragraphs = [p for p in text.split("\n\n") if len(p.split()) >= 8]
    out = []
    if genre == "code":
        for template in rng.sample(_CODE_DOC, min(n, len(_CODE_DOC))):
            out.append(Prompt((template.format(text=text),), "documents", "code_" + template.split()[0].lower(), writing.group))
        return out
    kinds = list(DOCUMENT_KINDS)
    rng.shuffle(kinds)
    for kind in kinds[:n]:
        if kind == "summarize":
            prompt = _pick(rng, _SUMMARIZE).format(doc=doc, text=text)
        elif kind == "answer":
            prompt = _pick(rng, _ANSWER).format(doc=doc, text=text, entity=_entity(rng, text, topic))
        elif kind == "continue":
            words = text.split(" ")
            prompt = _pick(rng, _CONTINUE).format(doc=doc, half=" ".join(words[: max(8, len(words) // 2)]))
        elif kind == "rewrite":
            prompt = _pick(rng, _REWRITE).format(doc=doc, text=text)
        else:
            part = _pick(rng, paragraphs) if paragraphs else text
            prompt = _pick(rng, _TRANSLATE_PART).format(language=_pick(rng, list(LANGUAGES.values())), part=part)
        out.append(Prompt((prompt,), "documents", kind, writing.group))
    return out


# ====================================================================================== installed package docs
_BADGE = re.compile(r"^\s*(\[!\[|!\[|\.\. (image|figure|raw)::|:target:|:alt:|<img|<a |<p |</?div|\|.*\|\s*$)")


def _clean_readme(text: str) -> str:
    lines = [l for l in text.replace("\r\n", "\n").split("\n") if not _BADGE.match(l)]
    text = "\n".join(lines)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


@dataclass(frozen=True)
class PackageDoc:
    name: str
    summary: str
    description: str  # cleaned README / long description ("" when there is none)


def package_docs(min_chars: int = 300) -> list[PackageDoc]:
    """Installed distributions' name, summary and cleaned description, sorted by name, one per name."""
    from importlib import metadata

    out: dict[str, PackageDoc] = {}
    for dist in metadata.distributions():
        try:
            meta = dist.metadata
            name = meta.get("Name") or ""
            summary = (meta.get("Summary") or "").strip()
            body = meta.get_payload() if hasattr(meta, "get_payload") else ""
            body = body or meta.get("Description") or ""
        except Exception:  # a broken METADATA file must not stop the build
            continue
        if not name or name.lower() in out:
            continue
        body = _clean_readme(str(body))
        out[name.lower()] = PackageDoc(name, summary if summary.upper() != "UNKNOWN" else "", body if len(body) >= min_chars else "")
    return [out[k] for k in sorted(out)]


_PACKAGE = (
    "Summarize this README in a few sentences:\n\n{text}",
    "Here is the documentation of the Python package {name}:\n\n{text}\n\nWhat is it for, and how do I install it?",
    "{text}\n\nBased on the text above, what are the main features of {name}?",
    "Explain to a beginner what {name} does, using this description:\n\n{text}",
    "I found this project description:\n\n{text}\n\nWould it help with this task: {need}? Explain briefly.",
    "Translate the first paragraph of this text into {language}:\n\n{first}",
)
_PASSAGES = (
    "{passages}\n\nQuestion: Which of these packages would you use for this: {need}? Explain your choice.",
    "Use the passages below to answer the question.\n\n{passages}\n\nQuestion: What does {name} do?",
)


def _need(summary: str) -> str:
    s = summary.strip().rstrip(".")
    return (s[0].lower() + s[1:]) if s else "working with data"


def package_prompts(rng: random.Random, docs: list[PackageDoc], n: int, max_chars: int) -> list[Prompt]:
    """n requests about installed packages' documentation (a document to summarise or answer from, or the
    summaries of three packages as passages for a retrieval-style question), group pkg:<name>."""
    with_text = [d for d in docs if d.description]
    with_summary = [d for d in docs if d.summary]
    out: list[Prompt] = []
    if not with_text and len(with_summary) < 3:
        return out
    order = list(range(len(with_text)))
    rng.shuffle(order)
    for i in range(n):
        if with_text and (len(with_summary) < 3 or rng.random() < 0.75):
            d = with_text[order[i % len(order)]]
            text = clip(d.description, max_chars)
            template = _pick(rng, _PACKAGE)
            first = next((p for p in text.split("\n\n") if len(p.split()) >= 8), text.split("\n\n")[0])
            prompt = template.format(text=text, name=d.name, need=_need(_pick(rng, with_summary).summary) if with_summary else "it",
                                     language=_pick(rng, list(LANGUAGES.values())), first=first)
            kind = ("summarize", "install", "features", "explain", "fit", "translate")[_PACKAGE.index(template)]
            out.append(Prompt((prompt,), "package_docs", kind, f"pkg:{d.name}"))
        else:
            chosen = rng.sample(with_summary, 3)
            target = _pick(rng, chosen)
            passages = "\n\n".join(f"Passage {j + 1} ({c.name}): {c.summary}" for j, c in enumerate(chosen))
            template = _pick(rng, _PASSAGES)
            prompt = template.format(passages=passages, need=_need(target.summary), name=target.name)
            out.append(Prompt((prompt,), "package_docs", "passages", f"pkg:{target.name}"))
    return out


# ====================================================================================== code from installed source
@dataclass(frozen=True)
class Function:
    name: str
    source: str  # the function's code, dedented
    docstring: str  # "" when none
    bare: str  # the code without its docstring
    where: str  # file:line


def python_roots() -> list[str]:
    """The standard library and site-packages directories of this interpreter."""
    paths = sysconfig.get_paths()
    return sorted({p for p in (paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")) if p and os.path.isdir(p)})


def _dedent(lines: list[str]) -> str:
    indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return "\n".join(l[indent:] for l in lines).strip("\n")


def functions_in(source: str, where: str, min_lines: int = 5, max_lines: int = 40) -> list[Function]:
    """Top-level functions and methods of a Python source text, min_lines..max_lines long (decorators
    excluded), with and without their docstrings. Unparsable text gives []."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = source.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        first, last = node.lineno - 1, node.end_lineno
        if not min_lines <= last - first <= max_lines:
            continue
        body = lines[first:last]
        doc = ast.get_docstring(node) or ""
        bare = body
        head = node.body[0] if node.body else None
        if doc and isinstance(head, ast.Expr) and head.end_lineno is not None:
            d0, d1 = head.lineno - 1 - first, head.end_lineno - first
            bare = body[:d0] + body[d1:]
            if len(bare) <= 1 or not "".join(bare[1:]).strip():
                continue  # nothing but a docstring
        out.append(Function(node.name, _dedent(body), doc.strip(), _dedent(bare), f"{where}:{node.lineno}"))
    return out


def find_functions(rng: random.Random, n: int, roots: list[str] | None = None, max_file_bytes: int = 200_000,
                   max_files: int = 4000) -> list[Function]:
    """About n distinct functions from .py files under the roots (files visited in a seeded random order;
    tests and private modules skipped), at most 2 per file."""
    files = []
    for root in roots if roots is not None else python_roots():
        for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
            parts = Path(os.path.relpath(f, root)).parts  # tests and vendored copies are not what users write
            if not any(x.startswith("test") or x == "_vendor" for x in parts):
                files.append(f)
    files = sorted(set(files))
    rng.shuffle(files)
    out: list[Function] = []
    seen: set[str] = set()
    for path in files[:max_files]:
        if len(out) >= n:
            break
        try:
            if os.path.getsize(path) > max_file_bytes:
                continue
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found = [f for f in functions_in(source, path) if f.source not in seen and not f.name.startswith("__")]
        for f in rng.sample(found, min(2, len(found))):
            seen.add(f.source)
            out.append(f)
    return out[:n]


_MUTATIONS = ((" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" == ", " != "), (" + 1", " - 1"),
              (" and ", " or "), ("return True", "return False"), ("[0]", "[1]"), (" is None", " is not None"))

_CODE = (
    ("explain", "Explain what this Python function does:\n\n```python\n{code}\n```"),
    ("explain", "Can you walk me through this code step by step?\n\n```python\n{code}\n```"),
    ("docstring", "Write a docstring for this function:\n\n```python\n{bare}\n```"),
    ("tests", "Write pytest unit tests for the following function.\n\n```python\n{code}\n```"),
    ("refactor", "Refactor this function to make it easier to read, keeping its behaviour.\n\n```python\n{code}\n```"),
    ("types", "Add type hints to this function.\n\n```python\n{bare}\n```"),
    ("port", "Rewrite this Python function in JavaScript.\n\n```python\n{bare}\n```"),
    ("complexity", "What is the time complexity of this function? Explain briefly.\n\n```python\n{bare}\n```"),
    ("review", "Review this code. Is there anything that could go wrong?\n\n```python\n{code}\n```"),
)


def code_prompts(rng: random.Random, functions: list[Function], n: int, max_chars: int) -> list[Prompt]:
    """n coding requests on the functions (one per function while they last), group fn:<file:line>."""
    out = []
    usable = [f for f in functions if len(f.source) <= max_chars]
    for f in usable[:n]:
        roll = rng.random()
        if f.docstring and roll < 0.2:  # write the function from its docstring
            sig = f.bare.split("\n", 1)[0].strip().rstrip(":")
            prompt = f"Write a Python function `{sig.removeprefix('def ').removeprefix('async def ')}` that does the following:\n\n{f.docstring}"
            kind = "implement"
        elif roll < 0.35:
            mutated = next((f.bare.replace(a, b, 1) for a, b in rng.sample(_MUTATIONS, len(_MUTATIONS)) if a in f.bare), None)
            if mutated is None:
                continue
            prompt = f"This function has a bug. Find it and give a fixed version.\n\n```python\n{mutated}\n```"
            kind = "fix"
        else:
            kind, template = _pick(rng, _CODE)
            prompt = template.format(code=f.source, bare=f.bare)
        out.append(Prompt((prompt,), "code", kind, f"fn:{f.where}"))
    return out


# ====================================================================================== translation
_TO_ENGLISH = (
    "Translate the following {language} text into English:\n\n{text}",
    "Translate to English: {text}",
    "What does this mean in English?\n\n{text}",
    "{language} to English, please:\n{text}",
)
_FROM_ENGLISH = (
    "Translate the following text into {language}:\n\n{text}",
    "How do I say this in {language}? \"{text}\"",
    "Translate into {language}:\n{text}",
)


def translation_prompts(rng: random.Random, pairs: list[TranslationPair], n: int, max_chars: int,
                        to_english: float = 0.75, max_group: int = 6) -> list[Prompt]:
    """n translation requests: about half single messages, the rest passages of 2..max_group messages of
    one catalogue; to English with probability `to_english`, else from English. Group tr:<lang>:<first>."""
    if not pairs:
        return []
    by_source: dict[tuple[str, str], list[TranslationPair]] = {}
    for p in pairs:
        by_source.setdefault((p.language, p.source), []).append(p)
    keys = sorted(by_source)
    out = []
    for _ in range(n):
        lang, src = _pick(rng, keys)
        items = by_source[(lang, src)]
        size = 1 if rng.random() < 0.5 else rng.randint(2, max_group)
        at = rng.randrange(len(items))
        chunk = items[at : at + size]
        into = rng.random() < to_english
        text = "\n".join(p.foreign if into else p.english for p in chunk)
        text = clip(text, max_chars)
        template = _pick(rng, _TO_ENGLISH if into else _FROM_ENGLISH)
        prompt = template.format(language=LANGUAGES[lang], text=text)
        out.append(Prompt((prompt,), "translation", f"{lang}-en" if into else f"en-{lang}", f"tr:{lang}:{chunk[0].english[:80]}"))
    return out


# ====================================================================================== follow-up turns
FOLLOWUPS = (
    "Can you make that shorter?", "Explain that in simpler words.", "Can you give me a concrete example?",
    "Turn your answer into a bulleted list.", "Translate your answer into French.", "Translate your answer into German.",
    "What are the limitations of this?", "Thanks! Can you summarize it in one sentence?",
    "Now write it as a short email to a colleague.", "Why is that?", "Can you add more detail to the first point?",
    "Are you sure? Please double-check your answer.", "Rewrite that in a more formal tone.",
    "What would you do differently?", "How would you explain this to a child?", "Give me three follow-up questions I could ask.",
)


def followup_prompts(rng: random.Random, first: Prompt, answer: str, second: str | None = None) -> Prompt:
    """The conversation first turn -> the target's answer -> a second user turn (`second`, e.g. a prompt
    file's own second turn, or a generic follow-up), in the first prompt's group."""
    follow = second if second is not None else _pick(rng, FOLLOWUPS)
    return Prompt((*first.turns, answer, follow), "multiturn", first.source, first.group)
