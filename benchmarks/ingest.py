"""Document ingestion: our jsonl/parquet reading and tokenizing against the tokenizer alone.

    .venv/bin/python benchmarks/ingest.py --mb 200 --json ingest.json
    .venv/bin/python benchmarks/ingest.py --mb 1024 --formats jsonl,parquet --dir /srv/scratch

Generates, once per size under `--dir`, a jsonl and a parquet file of about `--mb` MiB of
documents of random words (50 to 2,000 words each, from a fixed vocabulary of random "words"),
and a byte-level BPE tokenizer.json trained here on a sample of them (nothing is downloaded).
Trains no model. Then, each in a fresh child process (so that peak memory is the reading's own):

- raw: the `tokenizers` library alone: `Tokenizer.encode_batch` (and `encode_batch_fast`, which
  our reader calls) on the same documents in the same batches, timing only the library's calls
  (reading the texts is not counted);
- ours: `open_site_data` of a `[node.data]` source of the file, the cache cold (a new cache
  directory): reading, tokenizing, appending the end-of-document ids and writing the cache.

Reported per format: documents, tokens, seconds, tokens/s, our tokens/s over raw `encode_batch`
tokens/s (target >= 0.8) and the child's peak RSS growth while reading (target < 200 MB for a
1 GB file): VmHWM after `clear_refs` resets it, minus VmRSS before, from /proc/self (Linux);
elsewhere ru_maxrss, which cannot be reset, so the growth is over the start-up's peak.
Both sides use the tokenizer's default thread pool (all the machine's cores, or
RAYON_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCABULARY_WORDS = 20_000  # random "words" documents are drawn from: enough merges for BPE to do real work
WORDS_PER_DOCUMENT = (50, 2000)
WRITE_DOCUMENTS = 2048  # documents generated and written at a time (parquet: one row group each)
TOKENIZER_VOCAB = 16_000
TRAIN_SAMPLE_DOCUMENTS = 2000


def _words(rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 11, VOCABULARY_WORDS)
    return np.array(["".join(rng.choice(letters, n)) for n in lengths])


def _documents(rng: np.random.Generator, words: np.ndarray, count: int) -> list[str]:
    lengths = rng.integers(*WORDS_PER_DOCUMENT, count)
    # Zipf-like word frequencies, as text has: a few words common, most rare.
    ranks = np.minimum(rng.zipf(1.2, lengths.sum()), VOCABULARY_WORDS) - 1
    out, at = [], 0
    for n in lengths:
        out.append(" ".join(words[ranks[at:at + n]]))
        at += n
    return out


def generate(directory: Path, mib: int) -> dict[str, Path]:
    """jsonl and parquet files of about `mib` MiB of the same documents, and a tokenizer.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": directory / f"docs-{mib}mb.jsonl", "parquet": directory / f"docs-{mib}mb.parquet",
             "tokenizer": directory / "tokenizer.json"}
    if all(path.exists() for path in paths.values()):
        return paths
    rng = np.random.default_rng(0)
    words = _words(rng)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_documents(rng, words, TRAIN_SAMPLE_DOCUMENTS), trainer)
    tokenizer.save(str(paths["tokenizer"]))
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    written, next_id = 0, 0
    with open(paths["jsonl"], "w") as jsonl, pq.ParquetWriter(str(paths["parquet"]), schema) as parquet:
        while written < mib << 20:
            texts = _documents(rng, words, WRITE_DOCUMENTS)
            lines = "".join(json.dumps({"id": next_id + i, "text": t}) + "\n" for i, t in enumerate(texts))
            jsonl.write(lines)
            parquet.write_table(pa.table({"id": list(range(next_id, next_id + len(texts))), "text": texts},
                                         schema=schema))
            written += len(lines)
            next_id += len(texts)
    return paths


class PeakMemory:
    """Growth of the process's resident set from now to its peak (see the module docstring)."""

    def __init__(self) -> None:
        self.reset = False
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
            self.reset = True
        except OSError:
            pass
        self.start = self._status("VmRSS") if self.reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def growth(self) -> int:
        peak = self._status("VmHWM") if self.reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak - self.start


def child(mode: str, fmt: str, path: Path, tokenizer_path: Path, cache: Path) -> dict:
    from tokenizers import Tokenizer

    from diloco_node.config.site_data import SiteData
    from diloco_node.learn import data as data_lib
    from diloco_node.learn import documents as documents_lib

    if mode == "ours":
        spec = SiteData(fmt, (str(path),), str(tokenizer_path))
        memory = PeakMemory()
        start = time.perf_counter()
        corpus = data_lib.open_site_data(spec, cache)
        seconds = time.perf_counter() - start
        tokens = len(corpus.train) + len(corpus.eval)
        return {"documents": corpus.documents, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "rss_growth_mb": memory.growth() / 1e6}
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encode = getattr(tokenizer, mode)
    documents = tokens = 0
    seconds = 0.0
    for _, texts in documents_lib.iter_texts(path, fmt, "text"):
        start = time.perf_counter()
        encodings = encode(texts, add_special_tokens=False)
        seconds += time.perf_counter() - start
        documents += len(texts)
        tokens += sum(len(e.ids) for e in encodings) + len(texts)  # + one end-of-document id each, as ours
    return {"documents": documents, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_child(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child {args} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="size of each generated file, MiB")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "diloco-ingest")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--child", nargs=5, metavar=("MODE", "FORMAT", "PATH", "TOKENIZER", "CACHE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, fmt, path, tokenizer, cache = args.child
        print(json.dumps(child(mode, fmt, Path(path), Path(tokenizer), Path(cache))))
        return
    started = time.perf_counter()
    paths = generate(args.dir, args.mb)
    print(f"files under {args.dir} ({time.perf_counter() - started:.0f} s); {os.cpu_count()} cpus", flush=True)
    results = {"mb": args.mb, "cpus": os.cpu_count(), "formats": {}}
    for fmt in args.formats.split(","):
        size = paths[fmt].stat().st_size
        with tempfile.TemporaryDirectory(dir=args.dir) as cache:  # cold: a new cache every time
            ours = run_child("ours", fmt, str(paths[fmt]), str(paths["tokenizer"]), cache)
        raw = run_child("encode_batch", fmt, str(paths[fmt]), str(paths["tokenizer"]), "-")
        fast = run_child("encode_batch_fast", fmt, str(paths[fmt]), str(paths["tokenizer"]), "-")
        assert ours["tokens"] == raw["tokens"] == fast["tokens"], (ours, raw, fast)
        figures = {"file_mb": size / 1e6, "documents": ours["documents"], "tokens": ours["tokens"],
                   "raw_encode_batch_tokens_per_s": raw["tokens_per_s"],
                   "raw_encode_batch_fast_tokens_per_s": fast["tokens_per_s"],
                   "ours_tokens_per_s": ours["tokens_per_s"], "ours_seconds": ours["seconds"],
                   "ours_over_raw_encode_batch": ours["tokens_per_s"] / raw["tokens_per_s"],
                   "ours_over_raw_encode_batch_fast": ours["tokens_per_s"] / fast["tokens_per_s"],
                   "ours_rss_growth_mb": ours["rss_growth_mb"]}
        results["formats"][fmt] = figures
        print(f"{fmt}: {size / 1e6:,.0f} MB, {figures['documents']:,} documents, {figures['tokens']:,} tokens | "
              f"raw encode_batch {raw['tokens_per_s'] / 1e6:.2f} M tok/s, encode_batch_fast "
              f"{fast['tokens_per_s'] / 1e6:.2f} M tok/s | ours {ours['tokens_per_s'] / 1e6:.2f} M tok/s "
              f"({figures['ours_over_raw_encode_batch']:.2f} of encode_batch, "
              f"{figures['ours_over_raw_encode_batch_fast']:.2f} of encode_batch_fast), "
              f"peak RSS growth {ours['rss_growth_mb']:.0f} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
