"""What a site trains on: its `[node.data]` table, validated into a frozen `SiteData`.

Data belongs to the site, not to the run: every site names its own files (its own shards, its own
paths), so none of this is in the run manifest. What the sites of a run must agree on (the
vocabulary and context, `[run.model]`; the tokenizer's digest, `[run.data]`) is checked against
these settings when the data is opened (learn/data.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_node.config.manifest import ConfigError

SITE_SOURCES = ("stdlib", "text", "tokens")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")


@dataclass(frozen=True, slots=True)
class SiteData:
    """The `[node.data]` table (docs/DATA.md).

    source: "stdlib" (the interpreter's standard library, as bytes), "text" or "tokens".
    paths: files and globs (for text also directories), in the order they are read.
    tokenizer: a local tokenizer.json. For text, the ids are the tokenizer's ("" reads text as
    bytes, vocabulary 256); for token files it declares which tokenizer made them, so that its
    digest is checked against the run's.
    token_dtype: the id type of the token files, "uint16" or "uint32" ("uint8" for byte files);
    a `.npy` file's header must agree.
    eval_fraction: the held-out part, in (0, 0.5). seed: which text files are held out when a
    source is split by file path.
    """

    source: str = "stdlib"
    paths: tuple[str, ...] = ()
    tokenizer: str = ""
    token_dtype: str = ""
    eval_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in SITE_SOURCES:
            raise ConfigError(f"data.source = {self.source!r}: must be one of {', '.join(SITE_SOURCES)}")
        if isinstance(self.paths, str):  # a bare string would be taken for a list of its characters
            raise ConfigError(f"data.paths = {self.paths!r}: must be a list, e.g. paths = [{self.paths!r}]")
        paths = tuple(self.paths)
        if not all(isinstance(path, str) and path for path in paths):
            raise ConfigError(f"data.paths = {list(paths)!r}: every entry must be a non-empty path or glob")
        object.__setattr__(self, "paths", paths)
        if self.source == "stdlib" and paths:
            raise ConfigError("data.paths: source 'stdlib' reads no paths (use source 'text' or 'tokens')")
        if self.source != "stdlib" and not paths:
            raise ConfigError(f"data.paths: source {self.source!r} needs at least one file or glob")
        if not isinstance(self.tokenizer, str):
            raise ConfigError(f"data.tokenizer = {self.tokenizer!r}: must be the path of a tokenizer.json")
        if self.tokenizer and self.source == "stdlib":
            raise ConfigError("data.tokenizer: source 'stdlib' is read as bytes (use source 'text' to tokenize)")
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

    def describe(self) -> str:
        """One line for logs and `config show`."""
        if self.source == "stdlib":
            return "the standard library's .py files as bytes"
        what = f"{self.source} {', '.join(repr(p) for p in self.paths)}"
        if self.token_dtype:
            what += f" ({self.token_dtype})"
        if self.tokenizer:
            what += f", tokenizer {self.tokenizer!r}"
        return what
