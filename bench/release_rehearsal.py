"""Benchmark: the full-size release rehearsal of the Bonsai pair (issue #23).

Writes seeded full-size checkpoints in the published layouts into a Hugging Face cache at the revisions
``recipes/bonsai2_27b_dflash2.yaml`` pins, then runs that recipe UNCHANGED against the cache, offline:

- ``prism-ml/Ternary-Bonsai-2-27B-mlx-2bit`` @3f926b4: the MLX 2-bit pack (``prism_hadamard_qwen35``, schema 2) of
  a Qwen3.5-27B vision-language model (text geometry from the recipe's contract; a small vision tower whose keys the
  text model skips): every rotated matrix (the pack's published layout: each Gated DeltaNet
  ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj``, each attention ``q/k/v/o_proj``, each MLP ``gate/up/down_proj``,
  ``lm_head``, and ``embed_tokens`` inversely) as ternary codes (0, 1, 2 around zero point 1) packed 16 to a uint32
  word, the first in the lowest bits, an fp16 scale per 128 input columns, ``biases = -scales`` and its width's sign
  vector; the other language tensors in MLX's layout (zero-centred norms stored as 1 + w, ``conv1d`` as
  [channels, kernel, 1]) in bf16; config.json with the Prism fields and the ``modules`` list; hadamard.json
  (block 1024, one sign vector per input width); a tokenizer; in shards of about 4 GiB with an index.
- ``ProCreations/Ternary-Bonsai-2-27B-DFlash2`` @4cfb6ad: z-lab's DFlash2 layout (``model.safetensors`` and the
  selector's codebooks in ``selector.safetensors``) with the published config fields
  (z-lab's published Qwen3.8-27B-DFlash2 config: hidden 5120, intermediate 17408, 5 sliding layers of 32/8
  heads, vocab 248320, the dflash_config), bf16, 1.92B parameters.

The cache's snapshot directories are named by the pinned short revision padded with zeros (the real commits' full
hashes are not in the references). Seeded values: scales between 0.006 and 0.014 (a layer's output stays near unit
size over 64 layers), lm_head scales 0.05 (logits a few units apart), so the gate's statistics are finite; they
measure time, memory and sizes, and whether the gate passes is the gate's own verdict.

Then ``spec-convert build RECIPE`` in a child process with ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` and the build
cache under the work directory (``bench/scale_build.run_build``: stage seconds and the peak memory of the process
tree), then ``check-pair`` and ``inspect``; records the disk used, the bundle's bytes, its part count and sizes.
The checkpoints are written once (a marker file), and the build cache makes a second run resume (each run's log is
``build-<time>.log``). A run that spans sessions must run the same code each time (the cache keys hold the code's
sha256): run it from a copy of one commit, e.g. ``git archive COMMIT | tar -x -C DIR``, with ``PYTHONPATH=DIR``.

    PYTHONPATH=. python3 -m bench.release_rehearsal --workdir DIR [--write-only | --dry-run] [--json out.json]
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench.common import arguments, write_json

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "bonsai2_27b_dflash2.yaml"
PACK_REPO, PACK_REVISION = "prism-ml/Ternary-Bonsai-2-27B-mlx-2bit", "3f926b4"
DRAFTER_REPO, DRAFTER_REVISION = "ProCreations/Ternary-Bonsai-2-27B-DFlash2", "4cfb6ad"
BLOCK, GROUP = 1024, 128
SHARD_BYTES = 4 << 30
ROTATED = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
           "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")
L, F = "linear_attention", "full_attention"


def snapshot_dir(cache: Path, repo: str, revision: str) -> Path:
    """The snapshot directory of ``repo`` at ``revision`` (huggingface_hub's layout; ``refs/main`` names it)."""
    commit = revision + "0" * (40 - len(revision))
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return repo_dir / "snapshots" / commit


def text_config(layers: int = 64) -> dict:
    """The Qwen3.5-27B text settings the recipe's contract pins (``layers``: its first layers only, for benchmarks at
    the 27B width that the recipe does not plan)."""
    return dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers,
                layer_types=([L, L, L, F] * 16)[:layers], full_attention_interval=4, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                rms_norm_eps=1e-6, max_position_embeddings=262144, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
                bos_token_id=0, eos_token_id=1, pad_token_id=2)


def model_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen3.5 vision-language model's tensor names and shapes (built on the meta device)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def mlx_name(key: str) -> str:
    """mlx-vlm qwen3_5 ``sanitize``'s names: ``model.language_model.*`` -> ``language_model.model.*``,
    ``model.visual.*`` -> ``vision_tower.*``, ``lm_head`` -> ``language_model.lm_head``."""
    if key.startswith("model.visual."):
        return "vision_tower." + key.removeprefix("model.visual.")
    if key.startswith("model.language_model."):
        return "language_model.model." + key.removeprefix("model.language_model.")
    return "language_model." + key


def module_path(key: str) -> str | None:
    """The pack's module path of a rotated matrix (``model.layers.3.mlp.down_proj``, ``lm_head``), else None."""
    if key == "lm_head.weight":
        return "lm_head"
    if key == "model.language_model.embed_tokens.weight" or key.endswith(ROTATED):
        return "model." + key.removeprefix("model.language_model.").removesuffix(".weight")
    return None


TERNARY_BYTES = torch.tensor([a | b << 2 | c << 4 | d << 6 for a in range(3) for b in range(3) for c in range(3)
                              for d in range(3)], dtype=torch.uint8)
"""The 81 bytes whose four 2-bit codes are ternary (0, 1, 2): a word is four of them, little-endian (code k of a word
in bits 2k..2k+1, as the MLX pack stores them)."""


def ternary_words(rows: int, width: int, seed: int) -> torch.Tensor:
    """uint32 [rows, width / 16] of uniform ternary codes, made in row chunks on every core (each chunk its own
    generator, seeded from ``seed`` and its first row: the same words on any machine)."""
    step = max(1, (1 << 26) // width)

    def chunk(lo: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + lo)
        picks = torch.randint(0, len(TERNARY_BYTES), (min(step, rows - lo), width // 4), generator=generator,
                              dtype=torch.uint8)
        return TERNARY_BYTES[picks.long()]

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        packed = torch.cat(list(pool.map(chunk, range(0, rows, step))))
    return torch.from_numpy(packed.numpy().view(np.uint32))


def packed_matrix(shape: tuple[int, int], generator: torch.Generator, scale: tuple[float, float],
                  signs: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rotated matrix's tensors: ternary codes (a third of them the zero code 1), scales, biases and signs."""
    rows, width = shape
    words = ternary_words(rows, width, int(torch.randint(0, 1 << 30, (1,), generator=generator)))
    low, high = scale
    scales = (low + (high - low) * torch.rand(rows, width // GROUP, generator=generator)).to(torch.float16)
    return {"weight": words, "scales": scales, "biases": -scales, "signs": signs.clone()}


def dense_tensor(key: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A dense language or vision tensor as the pack stores it (bf16; MLX layouts)."""
    noise = torch.randn(shape, generator=generator)
    if key.endswith("A_log"):
        value = torch.log(1 + 15 * torch.rand(shape, generator=generator))
    elif key.endswith("dt_bias"):
        value = 0.1 * noise
    elif len(shape) == 1:
        value = 1.0 + 0.05 * noise  # a zero-centred norm stored as 1 + w, or a plain norm weight near 1
    else:
        value = 0.02 * noise
    if key.endswith("conv1d.weight") and len(shape) == 3:
        value = value.movedim(2, 1).contiguous()  # [C, 1, K] -> MLX's [C, K, 1]
    return value.to(torch.bfloat16)


class ShardWriter:
    """Tensors written to safetensors shards of about ``SHARD_BYTES``, with the index."""

    def __init__(self, directory: Path):
        self.directory, self.pending, self.size, self.shards = directory, {}, 0, []
        self.weight_map: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        number = len(self.shards)
        save_file(self.pending, str(self.directory / f"shard-{number}.safetensors"), metadata={"format": "mlx"})
        self.weight_map.update({name: number for name in self.pending})
        self.shards.append(number)
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        count = len(self.shards)
        names = {n: f"model-{n + 1:05d}-of-{count:05d}.safetensors" for n in self.shards}
        for n, name in names.items():
            (self.directory / f"shard-{n}.safetensors").rename(self.directory / name)
        index = {"metadata": {}, "weight_map": {k: names[n] for k, n in sorted(self.weight_map.items())}}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_pack(directory: Path, seed: int = 0, layers: int = 64) -> None:
    from transformers import Qwen3_5Config

    from bench.scale import _write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vision = dict(depth=2, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120, num_position_embeddings=2304)
    config = {"text_config": text_config(layers), "vision_config": vision, "tie_word_embeddings": False}
    shapes = model_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    widths = sorted({shape[1] for key, shape in shapes.items() if module_path(key)})
    signs = {w: (torch.randint(0, 2, (w,), generator=generator) * 2 - 1).to(torch.float32) for w in widths}
    writer, modules = ShardWriter(directory), []
    started = time.perf_counter()
    for count, (key, shape) in enumerate(shapes.items()):
        path = module_path(key)
        if path is None:
            writer.add(mlx_name(key), dense_tensor(key, shape, generator))
            continue
        scale = (0.05, 0.05) if path == "lm_head" else (0.006, 0.014)
        for part, tensor in packed_matrix(shape, generator, scale, signs[shape[1]]).items():
            writer.add(f"language_model.{path}.{part}", tensor)
        modules.append({"path": path, "block": BLOCK, "embedding": path == "model.embed_tokens", "dtype": "float16"})
        if count % 50 == 0:
            print(f"  pack: {count} of {len(shapes)} tensors, {time.perf_counter() - started:.0f} s", flush=True)
    writer.finish()
    hf = Qwen3_5Config(**config).to_dict()
    hf.update(architectures=["Qwen3_5ForConditionalGeneration"], model_type="prism_hadamard_qwen35",
              schema_version=2, base_model_type="qwen3_5", tensor_namespace="mlx-vlm-qwen3_5",
              requires_runtime="runtime/artifact.py", hadamard_config="hadamard.json",
              gdn_activation_layout="grouped", components={"text": True, "vision": True, "mtp": False},
              quantization={"bits": 2, "group_size": GROUP, "mode": "affine"}, modules=modules)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    hadamard = {
        "prism.hadamard.version": 1, "prism.hadamard.block_size": BLOCK,
        "prism.hadamard.transform": "normalized-sylvester-walsh-hadamard",
        "prism.hadamard.axis": "input-last-dimension", "prism.hadamard.sign_mode": "explicit",
        "prism.hadamard.weight_names": [f"language_model.{m['path']}.weight" for m in modules if not m["embedding"]],
        "prism.hadamard.inverse_weight_names": ["language_model.model.embed_tokens.weight"],
        "prism.hadamard.sign_widths": widths,
        "prism.hadamard.sign_values": [int(v) for w in widths for v in signs[w].tolist()],
        "prism.hadamard.gdn_v_grouped": True,
    }
    (directory / "hadamard.json").write_text(json.dumps(hadamard))
    _write_tokenizer(directory)


DRAFTER_TAPS = [5, 19, 33, 47, 61]


def drafter_config(layers: int = 5, taps: list[int] | None = None) -> dict:
    """The published DFlash2 config fields (z-lab's layout; the recipe's drafter contract); ``layers`` and ``taps``
    (the target layers it reads) for a drafter at the published width over a pack's first layers."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
        "layer_types": ["sliding_attention"] * layers, "sliding_window": 2048, "max_window_layers": layers,
        "num_target_layers": 64, "tie_word_embeddings": False, "eos_token_id": 248044, "dtype": "bfloat16",
        "dflash_config": {"block_size": 8, "mask_token_id": 248070, "conv_group_size": 16, "conv_kernel_size": 2,
                          "selector_rank": 256, "selector_top_k": 16,
                          "target_layer_ids": list(DRAFTER_TAPS if taps is None else taps)},
    }


def write_drafter(directory: Path, seed: int = 1, layers: int = 5, taps: list[int] | None = None) -> int:
    """The drafter's files (``drafter_config``'s ``layers`` and ``taps``); returns its parameter count."""
    from safetensors.torch import save_file

    from convert.models.dflash2.config import CODEBOOKS, SELECTOR_FILE, DFlash2Args, expected_shapes

    directory.mkdir(parents=True, exist_ok=True)
    config = drafter_config(layers, taps)
    shapes = expected_shapes(DFlash2Args.from_config(config))
    generator = torch.Generator().manual_seed(seed)
    main, selector = {}, {}
    for key, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        value = 1.0 + 0.05 * noise if len(shape) == 1 else noise / math.sqrt(shape[-1])
        (selector if key in CODEBOOKS else main)[key] = value.to(torch.bfloat16)
    save_file(main, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_file(selector, str(directory / SELECTOR_FILE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sum(math.prod(s) for s in shapes.values())


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workdir", type=Path, required=True, help="the HF cache, build cache and bundle go here")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoints and stop")
    parser.add_argument("--dry-run", action="store_true", help="write the checkpoints, then only plan the build")
    options = parser.parse_args()
    work = options.workdir.resolve()
    cache = work / "hf-cache"
    result: dict = {"recipe": str(RECIPE.relative_to(ROOT))}
    written = work / "written.json"
    if not written.is_file():
        start = time.perf_counter()
        write_pack(snapshot_dir(cache, PACK_REPO, PACK_REVISION))
        pack_seconds = time.perf_counter() - start
        parameters = write_drafter(snapshot_dir(cache, DRAFTER_REPO, DRAFTER_REVISION))
        written.write_text(json.dumps({"pack_seconds": round(pack_seconds, 1),
                                       "drafter_seconds": round(time.perf_counter() - start - pack_seconds, 1),
                                       "drafter_parameters": parameters,
                                       "pack_bytes": du(snapshot_dir(cache, PACK_REPO, PACK_REVISION)),
                                       "drafter_bytes": du(snapshot_dir(cache, DRAFTER_REPO, DRAFTER_REVISION))}))
    result["written"] = json.loads(written.read_text())
    print(json.dumps(result["written"]), flush=True)
    if options.write_only:
        return
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "SPEC_CONVERT_CACHE": str(work / "cache")}
    bundle = work / "bundle"
    if options.dry_run:
        plan = subprocess.run([sys.executable, "-m", "convert", "build", str(RECIPE), "-o", str(bundle), "--dry-run"],
                              env=env, capture_output=True, text=True)
        result["dry_run"] = {"exit_code": plan.returncode, "output": plan.stdout + plan.stderr}
        print(plan.stdout + plan.stderr)
    else:
        from bench.scale_build import run_build

        os.environ.update(env)
        # a log per run: a build resumed in a later session keeps the earlier runs' stage lines
        result["build"] = run_build(RECIPE, bundle, work / f"build-{time.strftime('%Y%m%d-%H%M%S')}.log", cached=True)
        for command in (["check-pair", str(bundle / "drafter"), str(bundle / "target")], ["inspect", str(bundle)]):
            done = subprocess.run([sys.executable, "-m", "convert", *command], env=env, capture_output=True, text=True)
            result[command[0]] = {"exit_code": done.returncode, "output": (done.stdout + done.stderr)[-4000:]}
        manifest = bundle / "target" / "manifest.json"
        if manifest.is_file():
            packages = json.loads(manifest.read_text())["packages"]
            result["target_parts"] = len({p.get("part") for p in packages})
            result["package_bytes"] = {p["path"]: sum(f["size"] for f in p["files"]) for p in packages}
    result["disk"] = {"hf_cache": du(cache), "build_cache": du(work / "cache"), "bundle": du(bundle)}
    write_json(options.json, result)


if __name__ == "__main__":
    main()
