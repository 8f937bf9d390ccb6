"""This engine against llama.cpp on the same random Kimi-Linear checkpoint, one thread, side by side.

The peer a CPU user would pick instead is llama.cpp (`llama-cpp-python`, the optional `llamacpp`
extra, builds it from source; its `kimi-linear` architecture runs KDA + MLA + MoE, with no DSA
indexer, so the checkpoint is a Kimi-Linear one). One run of this script:

1. writes a random `KimiLinearForCausalLM` (bench_forward.py's shape: hidden 512, 8 layers with MLA
   at 4 and 8, 32 experts top-4, fp32) with transformers, in the layout of Moonshot's released
   files, which is what llama.cpp's converter reads (see "What the converter needs" below);
2. converts it with llama.cpp's own `convert_hf_to_gguf.py` to f32 (and Q8_0) GGUF files;
3. runs each implementation in a fresh subprocess, on one thread, rounds interleaved (`--rounds`,
   order alternating): load, prefill the same T ids with every position's logits kept, then greedy
   decode at context T; each reports prefill tok/s, decode ms per token (wall and CPU, best round),
   the RSS after loading and the process's peak RSS (VmHWM, load included), and the peak so far
   after each phase (load, prefill, warm-up with the compile, decode): where the peak was reached;
4. compares the last position's logits of the prefills.

What the converter needs, and why (the random checkpoint is written to give it exactly this):
- the same head count for KDA and MLA layers (`num_attention_heads` = `linear_attn_config.num_heads`,
  4 here): llama.cpp's kimi-linear graph reads one `n_head` for both layer kinds
  (src/models/kimi-linear.cpp, `const int64_t n_head = hparams.n_head();` in the graph builder);
- the dense first layer's MLP named `model.layers.0.mlp.{gate,up,down}_proj` as in the released
  files: transformers saves it as `block_sparse_moe.*`, which the converter cannot map ("Can not map
  tensor"); this engine reads either name;
- `moe_router_activation_func: "sigmoid"` in config.json (the released config's key): without a
  gating function the GGUF lacks `kimi-linear.expert_gating_func` and llama.cpp refuses to load it;
- a vocabulary: the converter's `set_vocab` loads a tokenizer and recognises its pre-tokenizer by a
  hash of its output, which no random checkpoint has; the script runs the converter's `main()` with
  only `KimiLinearModel.set_vocab` swapped for its own `_set_vocab_none` (llama.cpp's "no vocab":
  token ids in, logits out). Every tensor name, hyperparameter and transform is the converter's.

The logits differ by one constant: llama.cpp normalises KDA's q and k with the model's RMSNorm
epsilon (`eps_norm = hparams.f_norm_rms_eps` in src/models/kimi-linear.cpp, 1e-5 here) where fla,
transformers and this engine use 1e-6 (`engine.layers.common.l2norm`). The script shows it: a second
engine prefill with that epsilon set to 1e-5 agrees with llama.cpp to fp32 rounding.

The converter is read from a llama.cpp source tree (`--llama-cpp-src`, or $LLAMA_CPP_SRC); without
one, the source distribution of the installed llama-cpp-python version is fetched once with
`pip download` into ~/.cache/k3-workbench/ (it vendors llama.cpp with the converter and its gguf-py).

    python benchmarks/bench_vs_llamacpp.py                       # T = 4096, 32 decode tokens, 2 rounds
    python benchmarks/bench_vs_llamacpp.py --tokens 1024 --rounds 1 --impls engine-compiled llama-f32-fa
    python benchmarks/bench_vs_llamacpp.py --engine-trees /tmp/wt-OLD .   # before/after in one run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench_forward import CONFIG as FORWARD_CONFIG, write_checkpoint
from measure import status_kb

HERE = Path(__file__).resolve().parent
# llama.cpp's kimi-linear graph reads one head count for KDA and MLA layers: both 4
CONFIG = dict(FORWARD_CONFIG, num_attention_heads=4, num_key_value_heads=4)
IMPLS = {
    # name: (side, options)
    "engine-compiled": ("engine", {"compile": True}),
    "engine-eager": ("engine", {"compile": False}),
    "llama-f32": ("llama", {"gguf": "f32", "flash_attn": False}),
    "llama-f32-fa": ("llama", {"gguf": "f32", "flash_attn": True}),
    "llama-q8_0-fa": ("llama", {"gguf": "q8_0", "flash_attn": True}),
}
LLAMA_KDA_L2_EPS = 1e-5  # = CONFIG's rms_norm_eps, which llama.cpp uses for KDA's q/k L2 norm


# ---------------------------------------------------------------------------------------------
# the checkpoint and its conversion


def write_released_layout(out: Path, seed: int) -> None:
    """The random checkpoint as Moonshot's released Kimi-Linear files name it (module docstring)."""
    from safetensors.torch import load_file, save_file

    write_checkpoint(out, seed, CONFIG)
    path = out / "model.safetensors"
    tensors = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["moe_router_activation_func"] = "sigmoid"
    config_path.write_text(json.dumps(config, indent=2))


def llama_cpp_source(given: Path | None) -> Path:
    """A directory holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    if given is None and os.environ.get("LLAMA_CPP_SRC"):
        given = Path(os.environ["LLAMA_CPP_SRC"])
    if given is not None:
        if not (given / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"{given} holds no convert_hf_to_gguf.py (give a llama.cpp source tree)")
        return given
    from importlib.metadata import version

    ver = version("llama-cpp-python")
    cache = Path.home() / ".cache" / "k3-workbench" / f"llama.cpp-{ver}"
    if (cache / "convert_hf_to_gguf.py").is_file():
        return cache
    print(f"fetching the llama-cpp-python {ver} source distribution for llama.cpp's converter ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={ver}", "-d", tmp], check=True, stdout=subprocess.DEVNULL)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.split("/vendor/llama.cpp/", 1)[-1] if "/vendor/llama.cpp/" in m.name else None
                if rel is not None and rel.startswith(keep) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            cache.mkdir(parents=True, exist_ok=True)
            tar.extractall(cache, members=members, filter="data")
    return cache


def convert(ckpt: Path, src: Path, outtype: str, out: Path) -> None:
    """llama.cpp's converter on `ckpt`, with only the vocabulary step replaced (module docstring)."""
    driver = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from conversion.base import TextModel\n"
        "from conversion.kimi_linear import KimiLinearModel\n"
        "KimiLinearModel.set_vocab = TextModel._set_vocab_none  # no tokenizer: ids in, logits out\n"
        "import convert_hf_to_gguf\n"
        "sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[2:]\n"
        "convert_hf_to_gguf.main()\n"
    )
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-c", driver, str(src), str(ckpt), "--outtype", outtype,
                               "--outfile", str(out)], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed ({outtype}); its log: {log}\n" + log.read_text()[-2000:])


# ---------------------------------------------------------------------------------------------
# the workers (one implementation, one fresh process)


def _ids(tokens: int) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(0).integers(3, CONFIG["vocab_size"], tokens)]


def engine_worker(ckpt: Path, options: dict, tokens: int, decode: int, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    if options.get("kda_l2_eps"):  # llama.cpp's constant, to show it is the whole difference
        import functools

        import engine.layers.kda as kda
        from engine.layers.common import l2norm

        kda.l2norm = functools.partial(l2norm, eps=options["kda_l2_eps"])
    from engine import load_model
    from engine.session import Session

    t0 = time.perf_counter()
    model = load_model(ckpt)
    load_s, rss_loaded, hwm_loaded = time.perf_counter() - t0, status_kb("VmRSS"), status_kb("VmHWM")
    model.runtime.compile = options.get("compile", False)
    session = Session(model, prefill_chunk=tokens)
    session.append(ids=_ids(tokens))
    t0, c0 = time.perf_counter(), time.process_time()
    logits = session.prefill(return_logits=True)  # every position's logits, as llama.cpp's logits_all
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    last = logits[-1].double().tolist()
    del logits
    result = {"load_s": load_s, "rss_loaded_kb": rss_loaded, "prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu_s,
              "peak_after_kb": {"load": hwm_loaded, "prefill": status_kb("VmHWM")}}
    if decode:
        t0 = time.perf_counter()
        list(session.generate(3, temperature=0, stop_ids=()))  # warm-up (the compile, on its first run)
        session.prefill()  # the last sampled token: the timed loop below holds decode steps only
        result["warmup_s"] = time.perf_counter() - t0
        result["peak_after_kb"]["warm-up"] = status_kb("VmHWM")
        steps0 = session.deployment.decode_steps
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in session.generate(decode, temperature=0, stop_ids=()):
            pass
        steps = max(1, session.deployment.decode_steps - steps0)
        result["decode_ms"] = 1000 * (time.perf_counter() - w0) / steps
        result["decode_cpu_ms"] = 1000 * (time.process_time() - c0) / steps
    result["peak_kb"] = status_kb("VmHWM")
    out.with_suffix(".logits.json").write_text(json.dumps(last))
    return result


def llama_worker(gguf: Path, options: dict, tokens: int, decode: int, out: Path) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=tokens + decode + 8, n_batch=512, n_ubatch=512, n_threads=1,
                n_threads_batch=1, logits_all=True, flash_attn=options["flash_attn"], verbose=False)
    load_s, rss_loaded, hwm_loaded = time.perf_counter() - t0, status_kb("VmRSS"), status_kb("VmHWM")
    t0, c0 = time.perf_counter(), time.process_time()
    llm.eval(_ids(tokens))  # every position's logits kept (logits_all)
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    last = np.asarray(llm.scores[tokens - 1], dtype=np.float64).tolist()
    result = {"load_s": load_s, "rss_loaded_kb": rss_loaded, "prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu_s,
              "peak_after_kb": {"load": hwm_loaded, "prefill": status_kb("VmHWM")}}
    if decode:
        for _ in range(3):  # warm-up, as the engine's
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        result["peak_after_kb"]["warm-up"] = status_kb("VmHWM")
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(decode):  # greedy, as the engine's
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        result["decode_ms"] = 1000 * (time.perf_counter() - w0) / decode
        result["decode_cpu_ms"] = 1000 * (time.process_time() - c0) / decode
    result["peak_kb"] = status_kb("VmHWM")
    out.with_suffix(".logits.json").write_text(json.dumps(last))
    return result


def run_worker(name: str, options: dict, work: Path, args: argparse.Namespace, decode: int,
               tree: Path = HERE.parent) -> dict:
    """One fresh process; an engine worker imports the engine of `tree` (PYTHONPATH, so an editable
    install elsewhere does not shadow it)."""
    out = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--worker", name, "--work", str(work), "--tokens", str(args.tokens),
           "--decode", str(decode), "--options", json.dumps(options), "--result", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    subprocess.run(cmd, check=True, env=env, cwd=tree)
    return json.loads(out.read_text())


def tree_label(tree: Path) -> str:
    """The tree's commit (short hash, '+' when it has uncommitted changes), else its directory name."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "engine"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return tree.name


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prefill length (decode runs at this context)")
    ap.add_argument("--decode", type=int, default=32, help="timed decode tokens")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each a fresh process per implementation)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--work", type=Path, help="directory for the checkpoint and GGUF files (kept; reused when there)")
    ap.add_argument("--llama-cpp-src", type=Path, help="llama.cpp source tree holding convert_hf_to_gguf.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-trees", type=Path, nargs="+", default=[HERE.parent],
                    help="source trees whose engines run side by side (before/after: `git worktree add DIR HASH`)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--options", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        options = json.loads(args.options)
        if args.worker.startswith("engine"):
            r = engine_worker(args.work / "kimi-linear", options, args.tokens, args.decode, args.result)
        else:
            r = llama_worker(args.work / f"kimi-linear-{options['gguf']}.gguf", options, args.tokens, args.decode,
                             args.result)
        args.result.write_text(json.dumps(r))
        return

    try:
        import llama_cpp
    except ImportError:
        print("bench_vs_llamacpp: skipped: llama_cpp is not installed (pip install 'k3-workbench[llamacpp]', "
              "which builds llama.cpp from source)")
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vs-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "kimi-linear"
    if not (ckpt / "config.json").exists():
        print(f"writing the checkpoint to {ckpt} ...", flush=True)
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                        f"from pathlib import Path; import bench_vs_llamacpp as b; "
                        f"b.write_released_layout(Path({str(ckpt)!r}), {args.seed})"], check=True)
    src = llama_cpp_source(args.llama_cpp_src)
    for outtype in sorted({IMPLS[name][1]["gguf"] for name in args.impls if IMPLS[name][0] == "llama"}):
        gguf = work / f"kimi-linear-{outtype}.gguf"
        if not gguf.exists():
            print(f"converting with llama.cpp's converter ({src}) to {outtype} ...", flush=True)
            convert(ckpt, src, outtype, gguf)

    # (label, impl, tree): every engine implementation once per tree, llama.cpp's once
    trees = [t.resolve() for t in args.engine_trees]
    labels = {t: tree_label(t) for t in trees}
    runs = [(f"{name}@{labels[t]}" if len(trees) > 1 and IMPLS[name][0] == "engine" else name, name, t)
            for name in args.impls for t in (trees if IMPLS[name][0] == "engine" else trees[:1])]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for r in range(args.rounds):
        for label, name, tree in (runs if r % 2 == 0 else runs[::-1]):
            results[label].append(run_worker(label, IMPLS[name][1], work, args, args.decode, tree))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    # the engine (the last tree's) with llama.cpp's KDA L2 epsilon: prefill logits only
    eps_run = run_worker("engine-l2eps", {"kda_l2_eps": LLAMA_KDA_L2_EPS}, work, args, 0, trees[-1])

    print(f"\nllama.cpp {llama_cpp.__version__} (llama-cpp-python) vs this engine; Kimi-Linear, hidden "
          f"{CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers (MLA at "
          f"{CONFIG['linear_attn_config']['full_attn_layers']}), {CONFIG['num_attention_heads']} heads, "
          f"{CONFIG['num_local_experts']} experts top-{CONFIG['num_experts_per_tok']}; T = {args.tokens}, one thread, "
          f"best of {args.rounds} interleaved rounds (fresh process each); '@' names an engine tree")
    width = max(16, *(len(label) for label in results))
    print(f"{'implementation':<{width}} {'prefill tok/s':>13} {'(CPU time)':>10} {'decode ms/tok':>13} "
          f"{'decode cpu ms':>13} {'RSS loaded MB':>13} {'peak RSS MB':>11}")
    best = {}
    for name, rows in results.items():
        b = {"prefill": max(args.tokens / x["prefill_s"] for x in rows),
             "prefill_cpu": max(args.tokens / x["prefill_cpu_s"] for x in rows),
             "decode": min(x["decode_ms"] for x in rows), "decode_cpu": min(x["decode_cpu_ms"] for x in rows),
             "loaded": min(x["rss_loaded_kb"] for x in rows) / 1024, "peak": min(x["peak_kb"] for x in rows) / 1024}
        best[name] = b
        print(f"{name:<{width}} {b['prefill']:>13.0f} {b['prefill_cpu']:>10.0f} {b['decode']:>13.2f} "
              f"{b['decode_cpu']:>13.2f} {b['loaded']:>13.0f} {b['peak']:>11.0f}")
    print("\nwhere the peak was reached: VmHWM (the peak so far) after each phase, MB, of the round with the lowest peak")
    phases = ("load", "prefill", "warm-up", "decode")
    print(f"{'implementation':<{width}} " + " ".join(f"{p:>9}" for p in phases) + "   each round's peak")
    for name, rows in results.items():
        low = min(rows, key=lambda x: x["peak_kb"])
        marks = dict(low["peak_after_kb"], decode=low["peak_kb"])
        print(f"{name:<{width}} " + " ".join(f"{marks[p] / 1024:>9.0f}" if p in marks else f"{'-':>9}" for p in phases)
              + "   " + " / ".join(f"{x['peak_kb'] / 1024:.0f}" for x in rows))
    engines = [n for n in best if n.startswith("engine")]
    llamas = [n for n in best if n.startswith("llama")]
    for e in engines:
        for ll in llamas:
            print(f"{e} vs {ll}: prefill (CPU time) {best[e]['prefill_cpu'] / best[ll]['prefill_cpu']:.2f}x, decode cpu ms "
                  f"{best[e]['decode_cpu'] / best[ll]['decode_cpu']:.2f}x, peak RSS {best[e]['peak'] / best[ll]['peak']:.2f}x")

    import numpy as np

    def logits(name: str) -> "np.ndarray":
        return np.array(json.loads((work / f"{name}.logits.json").read_text()))

    ref = next((n for n in llamas if n.startswith("llama-f32")), None)
    eng = next((n for n in reversed(engines) if n.startswith("engine-compiled")), engines[-1] if engines else None)
    if ref and eng:
        lr = logits(ref)

        def rel(x: "np.ndarray") -> float:
            return float(np.linalg.norm(x - lr) / np.linalg.norm(lr))

        print(f"\nlast position's logits, relative to {ref}: {eng} {rel(logits(eng)):.2e}; the engine with KDA's q/k "
              f"L2-norm epsilon {LLAMA_KDA_L2_EPS:g} (llama.cpp's) {rel(logits('engine-l2eps')):.2e}; "
              + "; ".join(f"{n} {rel(logits(n)):.2e}" for n in llamas if n != ref))
        print("(llama.cpp uses the RMSNorm epsilon for KDA's q/k L2 norm where the references use 1e-6: with that one "
              "constant matched the two agree to fp32 rounding; Q8_0 differs by its quantisation)")
    print(f"(files in {work}; eps run peak RSS {eps_run['peak_kb'] / 1024:.0f} MB)")


if __name__ == "__main__":
    main()
