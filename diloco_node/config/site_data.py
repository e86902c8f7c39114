"""What a site trains on: its `[node.data]` table, validated into a frozen `SiteData`.

Data belongs to the site, not to the run: every site names its own files (its own shards, its own
paths), so none of this is in the run manifest. What the sites of a run must agree on (the
vocabulary and context, `[run.model]`; the tokenizer's digest, `[run.data]`) is checked against
these settings when the data is opened (learn/data.py). A mixture (`[node.data.mix.NAME]`
tables) is several such sources with weights; each entry is validated here as a `SiteData` of
its own, filled in from the `[node.data]` keys it does not set. Separate eval sets
(`[node.data.eval.NAME]` tables) are sources read whole as held-out data, never trained on, each
resolved the same way (without a weight).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from diloco_node.config.manifest import ConfigError

# "documents" picks jsonl, parquet or arrow per file from its extension (DOCUMENT_EXTENSIONS).
DOCUMENT_SOURCES = ("documents", "jsonl", "parquet", "arrow")
SITE_SOURCES = ("stdlib", "text", "tokens") + DOCUMENT_SOURCES
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
# The file names each document format reads; a directory's other files are skipped, not read.
DOCUMENT_EXTENSIONS = {"jsonl": (".jsonl", ".jsonl.gz"), "parquet": (".parquet",), "arrow": (".arrow",)}
# The keys a mixture entry may set besides `weight`; what it leaves out comes from [node.data].
_INHERITED = ("source", "tokenizer", "token_dtype", "text_field", "eos_token", "eos_id", "eval_fraction", "seed")
# The keys an eval set may set: a set is read whole, so the split keys (eval_fraction, seed) mean
# nothing there and are refused rather than silently ignored.
_EVAL_KEYS = ("paths", "source", "tokenizer", "token_dtype", "text_field", "eos_token", "eos_id")
# The name of the held-out slice of the training data when reported beside eval sets (/status,
# /metrics' `set` label, `diloco-node eval`): an eval set may not take it.
HELD_OUT_SET = "held_out"


class MixEntry(NamedTuple):
    """One `[node.data.mix.NAME]` table, resolved: its name, weight and every `[node.data]` key
    (inherited ones filled in) as (key, value) pairs. Plain values, so `config show` prints it as
    it prints any key; `SiteData.mixture()` turns the pairs back into a `SiteData`."""

    name: str
    weight: float
    settings: tuple[tuple[str, Any], ...]


class EvalSet(NamedTuple):
    """One `[node.data.eval.NAME]` table, resolved like a `MixEntry` (inherited keys filled in),
    without a weight: a source read whole as held-out data. `SiteData.eval_sets()` rebuilds it."""

    name: str
    settings: tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class SiteData:
    """The `[node.data]` table (docs/DATA.md).

    source: "stdlib" (the interpreter's standard library, as bytes), "text", "tokens", or
    documents: "jsonl", "parquet", "arrow", or "documents" (each file's format from its
    extension). paths: files and globs (for text and documents also directories), in the order
    they are read.
    tokenizer: a local tokenizer.json. For text, the ids are the tokenizer's ("" reads text as
    bytes, vocabulary 256); documents need one; for token files it declares which tokenizer made
    them, so that its digest is checked against the run's.
    token_dtype: the id type of the token files, "uint16" or "uint32" ("uint8" for byte files);
    a `.npy` file's header must agree.
    text_field: the field (jsonl) or column (parquet, arrow) holding a document's text.
    eos_token / eos_id: the end-of-document token, by name (looked up in the tokenizer) or id;
    unset, documents end with the one the tokenizer declares. Beside token files, eos_id names
    the id that already separates their documents, so they are counted.
    eval_fraction: the held-out part, in (0, 0.5). seed: which files are held out when a source
    is split by file path.
    mix: the `[node.data.mix.NAME]` entries (a mapping of name to table, turned into `MixEntry`s);
    when set, `paths` stays empty and the other keys are the entries' defaults.
    eval: the `[node.data.eval.NAME]` sets (a mapping of name to table, turned into `EvalSet`s):
    separate held-out data, read whole and never trained on; when set, no slice of the training
    data is held out (docs/DATA.md "Separate eval sets").
    """

    source: str = "stdlib"
    paths: tuple[str, ...] = ()
    tokenizer: str = ""
    token_dtype: str = ""
    eval_fraction: float = 0.05
    seed: int = 0
    text_field: str = "text"
    eos_token: str = ""
    eos_id: int = -1
    mix: tuple[MixEntry, ...] = ()
    eval: tuple[EvalSet, ...] = ()

    def __post_init__(self) -> None:
        self._check_eval()
        if self.mix:
            self._check_mix()
            return
        if self.source not in SITE_SOURCES:
            raise ConfigError(f"data.source = {self.source!r}: must be one of {', '.join(SITE_SOURCES)}")
        if isinstance(self.paths, str):  # a bare string would be taken for a list of its characters
            raise ConfigError(f"data.paths = {self.paths!r}: must be a list, e.g. paths = [{self.paths!r}]")
        paths = tuple(self.paths)
        if not all(isinstance(path, str) and path for path in paths):
            raise ConfigError(f"data.paths = {list(paths)!r}: every entry must be a non-empty path or glob")
        object.__setattr__(self, "paths", paths)
        if self.source == "stdlib" and paths:
            raise ConfigError("data.paths: source 'stdlib' reads no paths (use source 'text', 'tokens' or a "
                              "document source)")
        if self.source != "stdlib" and not paths:
            raise ConfigError(f"data.paths: source {self.source!r} needs at least one file or glob")
        if not isinstance(self.tokenizer, str):
            raise ConfigError(f"data.tokenizer = {self.tokenizer!r}: must be the path of a tokenizer.json")
        if self.tokenizer and self.source == "stdlib":
            raise ConfigError("data.tokenizer: source 'stdlib' is read as bytes (use source 'text' to tokenize)")
        if self.source in DOCUMENT_SOURCES and not self.tokenizer:
            # Bytes (vocabulary 256) have no id left for an end-of-document token.
            raise ConfigError(f"data.tokenizer: source {self.source!r} needs a tokenizer.json (every document ends "
                              "with the tokenizer's end-of-document token; bytes have none): set data.tokenizer")
        if self.source == "tokens" and self.token_dtype not in TOKEN_DTYPES:
            # No default: reading uint32 files as uint16 would silently train on garbage.
            raise ConfigError(f"data.token_dtype = {self.token_dtype!r}: source 'tokens' needs the id type of its "
                              "files: 'uint16' or 'uint32' ('uint8' for byte files)")
        if self.source != "tokens" and self.token_dtype:
            raise ConfigError(f"data.token_dtype: only source 'tokens' reads token files (source is {self.source!r})")
        fraction = self.eval_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 0.5:
            raise ConfigError(f"data.eval_fraction = {fraction!r}: must be a number in (0, 0.5)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"data.seed = {self.seed!r}: must be an integer")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"data.text_field = {self.text_field!r}: must name the field holding the text")
        if not isinstance(self.eos_token, str):
            raise ConfigError(f"data.eos_token = {self.eos_token!r}: must be a token's text, e.g. \"</s>\"")
        if isinstance(self.eos_id, bool) or not isinstance(self.eos_id, int) or self.eos_id < -1:
            raise ConfigError(f"data.eos_id = {self.eos_id!r}: must be a token id (>= 0), or -1 for unset")
        if self.eos_token and self.source not in DOCUMENT_SOURCES + ("tokens",):
            raise ConfigError(f"data.eos_token: source {self.source!r} has no documents to end")
        if self.eos_id >= 0 and self.source not in DOCUMENT_SOURCES + ("tokens",):
            raise ConfigError(f"data.eos_id: source {self.source!r} has no documents to end")
        if self.eos_token and self.source == "tokens" and not self.tokenizer:
            raise ConfigError("data.eos_token: beside token files it is looked up in data.tokenizer, which is unset "
                              "(set data.eos_id instead)")

    def _check_mix(self) -> None:
        entries = self.mix
        if isinstance(entries, Mapping):
            entries = tuple(self._entry(name, table) for name, table in entries.items())
        if not isinstance(entries, tuple) or not all(isinstance(entry, MixEntry) for entry in entries):
            raise ConfigError(f"data.mix = {self.mix!r}: must be [node.data.mix.NAME] tables")
        object.__setattr__(self, "mix", entries)
        if self.paths:
            raise ConfigError("data.paths: a site with [node.data.mix.NAME] tables reads their paths; move "
                              f"{list(self.paths)!r} into one of them")
        tokenized = [entry.name for entry in entries if dict(entry.settings)["tokenizer"]]
        as_bytes = [entry.name for entry in entries if dict(entry.settings)["source"] in ("stdlib", "text")
                    and not dict(entry.settings)["tokenizer"]]
        if tokenized and as_bytes:
            raise ConfigError(f"data.mix: {', '.join(as_bytes)} read bytes while {', '.join(tokenized)} are tokenized; "
                              "one model reads one vocabulary: tokenize every entry or none")

    def _entry(self, name: Any, table: Any) -> MixEntry:
        where = f"data.mix.{name}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} = {table!r}: must be a table ([node.data.mix.{name}]) with paths and weight")
        table = dict(table)
        unknown = sorted(set(table) - {"weight", "paths", *_INHERITED})
        if "eval" in table or "mix" in table:
            raise ConfigError(f"{where}: a mixture entry holds no nested tables; [node.data.eval.NAME] and "
                              "[node.data.mix.NAME] belong in [node.data]")
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known: weight, paths, {', '.join(_INHERITED)}")
        weight = table.pop("weight", None)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight == float("inf"):
            raise ConfigError(f"{where}.weight = {weight!r}: every mixture entry needs a weight > 0 (its share of "
                              "the batches, relative to the other entries')")
        settings = self._inherited_by(where, table, _INHERITED)
        return MixEntry(str(name), float(weight), _settings_of(self._nested_source(where, settings)))

    def _check_eval(self) -> None:
        sets = self.eval
        if isinstance(sets, Mapping):
            sets = tuple(self._eval_set(name, table) for name, table in sets.items())
        if not isinstance(sets, tuple) or not all(isinstance(entry, EvalSet) for entry in sets):
            raise ConfigError(f"data.eval = {self.eval!r}: must be [node.data.eval.NAME] tables")
        object.__setattr__(self, "eval", sets)

    def _eval_set(self, name: Any, table: Any) -> EvalSet:
        where = f"data.eval.{name}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} = {table!r}: must be a table ([node.data.eval.{name}]) with paths")
        if str(name) == HELD_OUT_SET:
            raise ConfigError(f"{where}: {HELD_OUT_SET!r} names the held-out slice of the training data; "
                              "give the eval set another name")
        table = dict(table)
        unknown = sorted(set(table) - set(_EVAL_KEYS))
        if unknown:
            why = {"weight": " (eval sets are evaluated, not sampled)", "eval_fraction": " (an eval set is read whole)",
                   "seed": " (an eval set is read whole)"}.get(unknown[0], "")
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}{why}; known: {', '.join(_EVAL_KEYS)}")
        settings = self._inherited_by(where, table, [k for k in _INHERITED if k not in ("eval_fraction", "seed")])
        if settings["source"] not in DOCUMENT_SOURCES + ("tokens",) and not {"eos_token", "eos_id"} & set(table):
            settings["eos_token"], settings["eos_id"] = "", -1  # inherited from documents, it would be refused
        entry = self._nested_source(where, settings)
        if entry.source == "stdlib" and not self.mix and self.source == "stdlib":
            raise ConfigError(f"{where}: source 'stdlib' is this site's training data; an eval set may not be "
                              "trained on (name other files)")
        return EvalSet(str(name), _settings_of(entry))

    def _inherited_by(self, where: str, table: dict[str, Any], inherited: Iterable[str]) -> dict[str, Any]:
        """A nested table's settings: its own keys over `[node.data]`'s `inherited` ones. The tokenizer
        is the site's one; a token dtype meant for `[node.data]`'s token files is not inherited."""
        if table.get("tokenizer", self.tokenizer) != self.tokenizer:
            raise ConfigError(f"{where}.tokenizer: a site tokenizes with one tokenizer; set data.tokenizer once, "
                              "in [node.data]")
        settings = {key: getattr(self, key) for key in inherited} | table
        if settings["source"] != "tokens" and "token_dtype" not in table:
            settings["token_dtype"] = ""  # inherited from a [node.data] of token files, it would be refused
        return settings

    @staticmethod
    def _nested_source(where: str, settings: dict[str, Any]) -> SiteData:
        """A nested table's source, checked like `[node.data]`; errors name the table (`where`)."""
        try:
            return SiteData(**settings)
        except ConfigError as error:
            raise ConfigError(str(error).replace("data.", f"{where}.", 1)) from None
        except TypeError as error:
            raise ConfigError(f"{where}: {error}") from None

    def eval_sets(self) -> tuple[tuple[str, SiteData], ...]:
        """The separate eval sets as (name, SiteData), in the order they were given; () when none."""
        return tuple((entry.name, SiteData(**dict(entry.settings))) for entry in self.eval)

    def mixture(self) -> tuple[tuple[str, float, SiteData], ...]:
        """The mixture's entries as (name, weight, SiteData); () when this site reads one source."""
        return tuple((entry.name, entry.weight, SiteData(**dict(entry.settings))) for entry in self.mix)

    def leaves(self) -> tuple[SiteData, ...]:
        """The sources this site reads: the mixture's entries, or itself."""
        return tuple(data for _, _, data in self.mixture()) or (self,)

    def describe(self) -> str:
        """One line for logs and `config show`."""
        if self.mix:
            return "a mixture of " + "; ".join(f"{name} (weight {weight:g}): {data.describe()}"
                                               for name, weight, data in self.mixture())
        if self.source == "stdlib":
            return "the standard library's .py files as bytes"
        what = f"{self.source} {', '.join(repr(p) for p in self.paths)}"
        if self.token_dtype:
            what += f" ({self.token_dtype})"
        if self.tokenizer:
            what += f", tokenizer {self.tokenizer!r}"
        return what


def parse_mix(raw: Any, name: str, from_text: bool, resolve: Callable[[str], str], table_name: str = "mix") -> Any:
    """The `data.mix` (or, with `table_name="eval"`, `data.eval`) key's value as settings.py reads
    it: a TOML table of tables from a file, or the same as TOML inline-table text from the
    environment or a flag (`web = {paths = ["web/*.jsonl"], weight = 3}, code = {...}`). Paths and
    the tokenizer are made absolute with `resolve` (relative to the file that set them).
    Validation is `SiteData`'s."""
    example = ('wiki = {paths = [\"/srv/wiki.jsonl\"]}' if table_name == "eval"
               else 'web = {paths = [\"web/*.jsonl\"], weight = 3}')
    if from_text and isinstance(raw, str):
        text = raw.strip()
        if text and not text.startswith("{"):
            text = "{" + text + "}"
        try:
            raw = tomllib.loads(f"v = {text or '{}'}")["v"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{name}: not a TOML inline table of tables, e.g. '{example}' ({error})") from None
    if isinstance(raw, (tuple, list)) and not raw:
        return ()
    if not isinstance(raw, Mapping) or not all(isinstance(table, Mapping) for table in raw.values()):
        what = "paths" if table_name == "eval" else "paths and a weight"
        raise ConfigError(f"{name}: must be [node.data.{table_name}.NAME] tables, each with {what}")
    resolved = {}
    for entry, table in raw.items():
        table = dict(table)
        if isinstance(table.get("paths"), (list, tuple)):
            table["paths"] = tuple(resolve(p) if isinstance(p, str) and p else p for p in table["paths"])
        elif isinstance(table.get("paths"), str) and table["paths"]:
            table["paths"] = (resolve(table["paths"]),)
        if isinstance(table.get("tokenizer"), str) and table["tokenizer"]:
            table["tokenizer"] = resolve(table["tokenizer"])
        resolved[str(entry)] = table
    return resolved


def _settings_of(source: SiteData) -> tuple[tuple[str, Any], ...]:
    """A nested source's settings as the frozen (key, value) pairs a mix entry or eval set keeps."""
    return tuple((f.name, getattr(source, f.name)) for f in fields(SiteData) if f.name not in ("mix", "eval"))
