"""Documents in: jsonl, parquet and Arrow files read in bounded batches of texts, tokenized, and
ended with the tokenizer's end-of-document token.

A document is one record's text field (`[node.data] text_field`): one JSON object per line of a
`.jsonl` (or `.jsonl.gz`) file, one row of a `.parquet` file (read a row group at a time with
pyarrow, only the text column), or one row of an Arrow IPC file or stream (`.arrow`; a Hugging
Face dataset saved with `save_to_disk` is a directory of Arrow stream files, read here without
the `datasets` package, in the order its `state.json` lists them). Nothing is read whole:
`iter_texts` yields a few MiB of texts at a time, and `write_document_ids` tokenizes each batch
with `encode_batch` (the tokenizer's threads) while the next batch is read, writing the ids,
every document followed by the end-of-document id, to a file. A malformed record is a
`DocumentError` naming the file and the line (jsonl) or row (parquet, arrow): a site refuses to
start rather than train on garbage.

`find_eos` says which id ends a document: the one configured (`eos_id`, `eos_token`), else the
one the tokenizer declares (its `tokenizer_config.json` beside it, its post-processor, or a
special token of a well-known name).
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from diloco_node.config.site_data import DOCUMENT_EXTENSIONS

# A batch of texts handed to the tokenizer holds at most this many documents or bytes of text:
# enough documents for the tokenizer's threads to share, few enough that the texts, their
# encodings and their ids stay a few tens of MB whatever the file's size.
BATCH_DOCUMENTS = 1024
BATCH_TEXT_BYTES = 1 << 20
# Batches read ahead while the tokenizer encodes (it releases the GIL): reading overlaps encoding.
READ_AHEAD_BATCHES = 2
# End-of-document tokens by the names tokenizers give them, most specific first (GPT-2/Qwen,
# Llama 3, Llama 2/Mistral/T5, Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# The first bytes of an Arrow IPC *file* (random access, with a footer); a stream has none.
ARROW_FILE_MAGIC = b"ARROW1"
# Parquet is read through a buffered stream of this size instead of whole column chunks fetched
# ahead (pyarrow's pre_buffer): on a 200 MB file this took the reading's peak from 190 to 110 MB.
PARQUET_READ_BUFFER = 1 << 20
PYARROW_MISSING = "install the 'parquet' extra: pip install 'diloco-node[parquet]'"


class DocumentError(ValueError):
    """A document file cannot be used; the message names the file and the line or row."""


def document_format(path: Path) -> str | None:
    """"jsonl", "parquet" or "arrow" by the file's extension, None for any other file."""
    name = path.name.lower()
    for fmt, extensions in DOCUMENT_EXTENSIONS.items():
        if name.endswith(extensions):
            return fmt
    return None


def _hf_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face `save_to_disk` directory in its own order (its
    `state.json` lists them under `_data_files`), or None when it is not one."""
    state = directory / "state.json"
    if not (state.is_file() and (directory / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DocumentError(f"dataset directory {str(directory)!r}: its state.json does not list the data files "
                            f"(_data_files: [{{filename: ...}}]): {error!r}") from None
    return [directory / name for name in names]


def expand_document_paths(patterns: Sequence[str], source: str) -> list[tuple[Path, str]]:
    """(file, format) for every document file that paths, directories (every file below whose
    extension is a document format's) or globs (likewise filtered) name, in order. With a source
    of one format, only that format's files are taken from directories and globs; a file named
    explicitly is read in that format whatever its name. "documents" takes each file's format
    from its extension."""
    wanted = tuple(DOCUMENT_EXTENSIONS) if source == "documents" else (source,)

    def fits(path: Path) -> str | None:
        fmt = document_format(path)
        return fmt if fmt in wanted else None

    names = " or ".join(ext for fmt in wanted for ext in DOCUMENT_EXTENSIONS[fmt])
    found: list[tuple[Path, str]] = []
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            import glob  # noqa: PLC0415 - only globs need it

            matches = [Path(m) for m in sorted(glob.glob(os.path.expanduser(pattern), recursive=True))]
            files = [(path, fmt) for path in matches if path.is_file() and (fmt := fits(path))]
            if not files:
                raise DocumentError(f"document files {pattern!r}: the glob matches no {names} file")
            found.extend(files)
            continue
        path = Path(os.path.expanduser(pattern))
        if not path.exists():
            raise DocumentError(f"document files {pattern!r}: no such file or directory")
        if path.is_dir():
            listed = _hf_dataset_files(path) if "arrow" in wanted else None
            candidates = listed if listed is not None else sorted(p for p in path.rglob("*") if p.is_file())
            files = [(p, fmt) for p in candidates if (fmt := fits(p))]
            if not files:
                raise DocumentError(f"document directory {pattern!r}: holds no {names} file")
            found.extend(files)
            continue
        fmt = document_format(path) if source == "documents" else source
        if fmt is None:
            raise DocumentError(f"document file {pattern!r}: its extension names no document format "
                                f"({names}); set data.source to jsonl, parquet or arrow to read it as one")
        found.append((path, fmt))
    return found


# --- Reading: batches of (first record's number, texts) ----------------------------------------


def _jsonl_texts(path: Path, field: str, batch_documents: int, batch_bytes: int) -> Iterator[tuple[int, list[str]]]:
    opener: Callable[..., BinaryIO] = gzip.open if path.name.lower().endswith(".gz") else open  # type: ignore[assignment]
    texts: list[str] = []
    size, first = 0, 1
    try:
        with opener(path, "rb") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue  # a blank line (often the last) is no record
                try:
                    record = json.loads(line)
                except ValueError as error:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
                    raise DocumentError(f"jsonl file {str(path)!r} line {number}: not a JSON object ({error}); "
                                        "fix or remove the line") from None
                if not isinstance(record, dict) or field not in record:
                    shown = f"fields: {', '.join(list(record)[:8])}" if isinstance(record, dict) else type(record).__name__
                    raise DocumentError(f"jsonl file {str(path)!r} line {number}: no {field!r} field ({shown}); "
                                        "set data.text_field to the field holding the text")
                text = record[field]
                if not isinstance(text, str):
                    raise DocumentError(f"jsonl file {str(path)!r} line {number}: field {field!r} is "
                                        f"{type(text).__name__}, not a string")
                if not texts:
                    first = number
                texts.append(text)
                size += len(line)
                if len(texts) >= batch_documents or size >= batch_bytes:
                    yield first, texts
                    texts, size = [], 0
    except (OSError, EOFError) as error:  # EOFError: a truncated .gz
        raise DocumentError(f"jsonl file {str(path)!r}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    if texts:
        yield first, texts


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: PLC0415 - an optional extra, needed only for parquet and arrow
        import pyarrow.ipc  # noqa: F401, PLC0415
        import pyarrow.parquet  # noqa: F401, PLC0415
    except ImportError:
        raise DocumentError(f"parquet and arrow files need pyarrow: {PYARROW_MISSING}") from None
    return pyarrow


def _check_column(pa: Any, schema: Any, path: Path, field: str, what: str) -> None:
    if field not in schema.names:
        raise DocumentError(f"{what} file {str(path)!r}: no column {field!r} (columns: {', '.join(schema.names[:8])}); "
                            "set data.text_field to the column holding the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise DocumentError(f"{what} file {str(path)!r}: column {field!r} holds {kind}, not strings")


def _column_texts(column: Any, path: Path, field: str, what: str, first_row: int) -> list[str]:
    if column.null_count:
        row = first_row + int(column.is_null().to_numpy(zero_copy_only=False).argmax())
        raise DocumentError(f"{what} file {str(path)!r} row {row}: column {field!r} is null, not a string")
    return column.to_pylist()


def _sliced(pa: Any, batches: Iterator[Any], path: Path, field: str, what: str,
            batch_documents: int, batch_bytes: int) -> Iterator[tuple[int, list[str]]]:
    """Record batches as batches of texts of bounded size; rows are counted from 0 over the file."""
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        # Rows per piece so that a piece holds about batch_bytes of text.
        text_bytes = column.nbytes or 1
        step = max(1, min(batch_documents, len(column) * batch_bytes // text_bytes))
        for start in range(0, len(column), step):
            piece = column.slice(start, step)
            yield row + start, _column_texts(piece, path, field, what, row + start)
        row += len(column)


def _parquet_texts(path: Path, field: str, batch_documents: int, batch_bytes: int) -> Iterator[tuple[int, list[str]]]:
    pa = _pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(str(path), pre_buffer=False, buffer_size=PARQUET_READ_BUFFER)
    except (pa.ArrowException, OSError) as error:
        raise DocumentError(f"parquet file {str(path)!r}: not a readable parquet file ({error})") from None
    _check_column(pa, parquet.schema_arrow, path, field, "parquet")
    try:
        # Row group by row group, the text column only: memory is bounded by a row group's texts.
        yield from _sliced(pa, parquet.iter_batches(columns=[field], batch_size=batch_documents,
                                                      use_threads=False), path, field,
                           "parquet", batch_documents, batch_bytes)
    except (pa.ArrowException, OSError) as error:
        raise DocumentError(f"parquet file {str(path)!r}: cannot read it ({error})") from None
    finally:
        parquet.close()


def _arrow_texts(path: Path, field: str, batch_documents: int, batch_bytes: int) -> Iterator[tuple[int, list[str]]]:
    pa = _pyarrow()
    try:
        source = pa.memory_map(str(path), "r")  # record batches are views of the map: page cache, not memory
    except (pa.ArrowException, OSError) as error:
        raise DocumentError(f"arrow file {str(path)!r}: cannot read it ({error})") from None
    try:
        try:
            if source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
                reader = pa.ipc.open_file(source)
                batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
        except pa.ArrowException as error:
            raise DocumentError(f"arrow file {str(path)!r}: not an Arrow IPC file or stream ({error})") from None
        _check_column(pa, reader.schema, path, field, "arrow")
        try:
            yield from _sliced(pa, batches, path, field, "arrow", batch_documents, batch_bytes)
        except pa.ArrowException as error:
            raise DocumentError(f"arrow file {str(path)!r}: cannot read it ({error})") from None
    finally:
        source.close()


_READERS = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "arrow": _arrow_texts}


def iter_texts(path: Path, fmt: str, field: str, *, batch_documents: int = BATCH_DOCUMENTS,
               batch_bytes: int = BATCH_TEXT_BYTES) -> Iterator[tuple[int, list[str]]]:
    """The file's documents' texts in batches of at most `batch_documents` (and about
    `batch_bytes` of text), each with the number of its first record: the line (from 1) of a
    jsonl file, the row (from 0) of a parquet or arrow file."""
    return _READERS[fmt](path, field, batch_documents, batch_bytes)


def _read_ahead(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """`batches`, produced by a thread up to `depth` ahead (its errors raised here, in order)."""
    slots: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        slots.put(("batch", batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put(("end", None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            slots.put(("error", error))

    thread = threading.Thread(target=produce, name="document-reader", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = slots.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue, then let it end
            try:
                slots.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


# --- Tokenizing ---------------------------------------------------------------------------------


def _encoder(tokenizer: Any) -> Callable[[list[str]], list[Any]]:
    # No special tokens: the end-of-document id is appended here, once per document; a
    # post-processor's BOS/EOS would differ between tokenizers. `encode_batch_fast` (tokenizers
    # >= 0.20) skips the character offsets nobody reads here; the ids are the same.
    fast = getattr(tokenizer, "encode_batch_fast", None)
    encode = fast or tokenizer.encode_batch
    return lambda texts: encode(texts, add_special_tokens=False)


def write_document_ids(files: Sequence[tuple[Path, str]], field: str, tokenizer: Any, eos_id: int,
                       out: Any, *, batch_documents: int | None = None,
                       batch_bytes: int | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """Tokenize every document of the files into `out` as uint32 ids, each document followed by
    `eos_id`; returns each file's [start, stop) in the ids and its number of documents. An empty
    text is skipped (it would be a lone end-of-document token). Batches are BATCH_DOCUMENTS and
    BATCH_TEXT_BYTES unless given."""
    encode = _encoder(tokenizer)
    batch_documents = batch_documents or BATCH_DOCUMENTS
    batch_bytes = batch_bytes or BATCH_TEXT_BYTES
    ranges: list[tuple[int, int]] = []
    counts: list[int] = []
    written = 0
    for path, fmt in files:
        start, documents = written, 0
        batches = iter_texts(path, fmt, field, batch_documents=batch_documents, batch_bytes=batch_bytes)
        for _, texts in _read_ahead(batches, READ_AHEAD_BATCHES):
            texts = [text for text in texts if text]
            if not texts:
                continue
            flat: list[int] = []
            for encoding in encode(texts):
                flat.extend(encoding.ids)
                flat.append(eos_id)
            ids = np.array(flat, dtype=np.uint32)
            out.write(ids.data)
            written += len(ids)
            documents += len(texts)
        ranges.append((start, written))
        counts.append(documents)
    return ranges, counts


# --- The end-of-document token ------------------------------------------------------------------


def _post_processor_eos(processor: Any) -> str | None:
    """The special token a TemplateProcessing post-processor puts after a single sequence ($A)."""
    if not isinstance(processor, dict):
        return None
    if processor.get("type") == "Sequence":
        for inner in processor.get("processors") or []:
            found = _post_processor_eos(inner)
            if found:
                return found
        return None
    if processor.get("type") != "TemplateProcessing":
        return None
    after_sequence = False
    for piece in processor.get("single") or []:
        if isinstance(piece, dict) and "Sequence" in piece:
            after_sequence = True
        elif after_sequence and isinstance(piece, dict) and "SpecialToken" in piece:
            return piece["SpecialToken"].get("id")
    return None


def find_eos(tokenizer: Any, tokenizer_path: str, eos_token: str = "", eos_id: int = -1) -> tuple[int, str]:
    """(id, how it was found) of the end-of-document token: `eos_id`, else `eos_token` looked up
    in the tokenizer, else the tokenizer's own: `eos_token` of a `tokenizer_config.json` beside
    the tokenizer.json, the token its post-processor appends to a sequence, or a special token of
    a name in EOS_NAMES. A DocumentError says what to set when none is found."""
    where = f"node.data.tokenizer {tokenizer_path!r}"
    vocab_size = int(tokenizer.get_vocab_size())
    if eos_id >= 0:
        if eos_id >= vocab_size:
            raise DocumentError(f"data.eos_id = {eos_id}: not an id of {where} (vocabulary {vocab_size})")
        if eos_token and tokenizer.token_to_id(eos_token) != eos_id:
            raise DocumentError(f"data.eos_token = {eos_token!r} is id {tokenizer.token_to_id(eos_token)} in {where}, "
                                f"but data.eos_id = {eos_id}: set one of them")
        return eos_id, f"data.eos_id ({tokenizer.id_to_token(eos_id)!r})"
    if eos_token:
        found = tokenizer.token_to_id(eos_token)
        if found is None:
            raise DocumentError(f"data.eos_token = {eos_token!r}: not a token of {where}")
        return int(found), f"data.eos_token {eos_token!r}"
    config = Path(tokenizer_path).with_name("tokenizer_config.json")
    if config.is_file():
        try:
            declared = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            declared = None
        if isinstance(declared, dict):
            declared = declared.get("content")
        if isinstance(declared, str) and tokenizer.token_to_id(declared) is not None:
            return int(tokenizer.token_to_id(declared)), f"{declared!r} ({config.name})"
    try:
        described = json.loads(tokenizer.to_str())
    except ValueError:
        described = {}
    appended = _post_processor_eos(described.get("post_processor"))
    if appended and tokenizer.token_to_id(appended) is not None:
        return int(tokenizer.token_to_id(appended)), f"{appended!r} (the tokenizer's post-processor)"
    specials = {token.get("content") for token in described.get("added_tokens") or [] if token.get("special")}
    for name in EOS_NAMES:
        if name in specials and tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name)), f"{name!r} (a special token of the tokenizer)"
    for name in EOS_NAMES:
        if tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name)), f"{name!r} (in the tokenizer's vocabulary)"
    raise DocumentError(f"{where}: declares no end-of-document token (no tokenizer_config.json eos_token, no token "
                        f"after the sequence in its post-processor, none of {', '.join(EOS_NAMES)}): set "
                        "data.eos_token to its text or data.eos_id to its id")


def count_id(stream: Any, token_id: int, chunk: int) -> int:
    """How often `token_id` occurs in a token array or stream, read `chunk` ids at a time."""
    total = 0
    for start in range(0, len(stream), chunk):
        total += int(np.count_nonzero(np.asarray(stream[start:start + chunk]) == token_id))
    return total
