"""``aiserve models quantize NAME@VERSION --scheme int8|int4``: a quantized copy as a new version.

The base version is verified, its products quantized with torchao
(services/inference/quantize.py), and the result installed as ``VERSION-SCHEME`` with its own
manifest: the quantized weights in one ``torch.save`` file (``QUANTIZED_FILE``), the config and
tokenizer files copied, every file hashed, and a ``quantization`` entry naming the scheme, the
library and the base. The base version's folder is only read. Then both versions decode 16
tokens at batch 1 on this machine (in turn, best of three), and the command says how the speeds compare (on CPUs without
fast int8 kernels a quantized version saves memory, not time: docs/quantization.md).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch

from aiserve.common.cpu import read_cpu_flags
from aiserve.model_facts import CONFIG_FILE
from aiserve.store import WEIGHT_SUFFIXES, Manifest, ModelRef, ModelStore, ModelStoreError
from services.inference.llama import LlamaModel
from services.inference.llama_weights import QUANTIZED_FILE, read_tensors
from services.inference.model import TORCH_DTYPES
from services.inference.offline import DecodeSpeed, OfflineModel, torch_threads
from services.inference.precision import AUTO, choose_precision
from services.inference.quantize import SCHEMES, quantize_tensors, torchao_version

SPEED_TOKENS = 16
SPEED_ROUNDS = 3
SPEED_PROMPT = "The history of the printing press begins"


def quantized_ref(ref: ModelRef, scheme: str) -> ModelRef:
    """The new version's name: the base version with the scheme appended (``0.1.2-int8``)."""
    return ModelRef(ref.name, f"{ref.version}-{scheme}")


def quantize_version(store: ModelStore, ref: ModelRef, scheme_name: str, force: bool = False) -> Manifest:
    """Write ``quantized_ref(ref, scheme_name)`` into ``store`` from the verified ``ref``;
    ModelStoreError when the base is quantized already or the target exists (unless ``force``)."""
    scheme = SCHEMES[scheme_name]
    folder, base = store.load_path(ref)
    if base.quantization is not None:
        raise ModelStoreError(f"{ref} is already quantized ({base.quantization.get('scheme')}); quantize its base")
    target = quantized_ref(ref, scheme_name)
    if store.path(target).exists() and not force:
        raise ModelStoreError(f"{target} is already in the store (pass --force to write it again)")
    num_layers = int(json.loads((folder / CONFIG_FILE).read_text())["num_hidden_layers"])
    state = quantize_tensors(read_tensors(folder), num_layers, scheme)
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".quantize-", dir=store.root) as tmp:
        out = Path(tmp) / "model"
        out.mkdir()
        for name in base.files:
            if not name.endswith(WEIGHT_SUFFIXES):
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, out / name)
        torch.save(state, out / QUANTIZED_FILE)
        weights = {name: sha for name, sha in base.files.items() if name.endswith(WEIGHT_SUFFIXES)}
        quantization = {"scheme": scheme.name, "library": f"torchao {torchao_version()}",
                        "config": scheme.config_name, "note": scheme.note, "base": str(ref),
                        "base_weights_sha256": json.dumps(weights, sort_keys=True),
                        "quantized": "decoder layers' products; embedding, norms, lm_head kept in bfloat16"}
        return store.install(target, out, {"quantized_from": str(ref)}, quantization)


def decode_speeds(folders: Sequence[Path], tokens: int = SPEED_TOKENS, rounds: int = SPEED_ROUNDS,
                  threads: int = 1) -> list[DecodeSpeed]:
    """Greedy decode speed of each version in ``folders`` at batch 1 on ``threads`` torch
    threads, in the precision the service would choose here: all loaded, then timed in turn for
    ``rounds`` rounds (after an untimed warm-up), keeping each one's fastest, so a burst of load
    on a shared machine hits both alike rather than one of them."""
    with torch_threads(threads):
        return _decode_speeds(folders, tokens, rounds)


def _decode_speeds(folders: Sequence[Path], tokens: int, rounds: int) -> list[DecodeSpeed]:
    from tokenizers import Tokenizer

    precision = choose_precision("cpu", read_cpu_flags(), AUTO, AUTO)
    runners = [OfflineModel(LlamaModel.load(f, "cpu", TORCH_DTYPES[precision.weights],
                                            TORCH_DTYPES[precision.matmul])) for f in folders]
    prompt = Tokenizer.from_file(str(folders[0] / "tokenizer.json")).encode(SPEED_PROMPT).ids
    for runner in runners:
        runner.decode_speed(prompt, 4)
    timed = [[runner.decode_speed(prompt, tokens) for runner in runners] for _ in range(rounds)]
    return [min((row[i] for row in timed), key=lambda s: s.seconds) for i in range(len(runners))]


def speed_verdict(scheme: str, quantized: DecodeSpeed, base: DecodeSpeed, threads: int = 1) -> str:
    """One line comparing the two measured speeds, saying plainly when the scheme is slower."""
    ratio = quantized.tokens_per_s / base.tokens_per_s
    figures = (f"{scheme}: {quantized.tokens_per_s:.1f} tok/s, base: {base.tokens_per_s:.1f} tok/s "
               f"({ratio:.2f}x; greedy decode of {quantized.tokens} tokens, batch 1, {threads} torch thread"
               f"{'s' if threads > 1 else ''})")
    if ratio < 1.0:
        return f"{scheme} is SLOWER than the base on this CPU: {figures}; it saves memory, not time"
    return f"{scheme} is not slower than the base on this CPU: {figures}"


def run_quantize(store: ModelStore, ref: ModelRef, scheme: str, force: bool, out: TextIO,
                 measure: bool = True, threads: int = 1) -> Manifest:
    """The command: quantize, report the files, and (``measure``) compare decode speeds."""
    manifest = quantize_version(store, ref, scheme, force)
    folder = store.path(manifest.ref)
    size = sum((folder / name).stat().st_size for name in manifest.files if name.endswith(WEIGHT_SUFFIXES))
    base_size = sum((store.path(ref) / n).stat().st_size for n in store.manifest(ref).files
                    if n.endswith(WEIGHT_SUFFIXES))
    print(f"wrote {manifest.ref} into {folder}: weights {size / 2**20:.1f} MiB on disk "
          f"(base {base_size / 2**20:.1f} MiB), {len(manifest.files)} files hashed", file=out, flush=True)
    if measure:
        print("measuring decode speed of both versions ...", file=out, flush=True)
        quantized, base = decode_speeds([folder, store.path(ref)], threads=threads)
        print(speed_verdict(scheme, quantized, base, threads), file=out, flush=True)
    return manifest
