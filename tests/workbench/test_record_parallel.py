"""Recording under tensor/expert parallelism: every signal exactly once, none partial.

The same greedy session runs in one process and under torchrun with 2 gloo ranks (KDA and MLA
heads split, experts split); the two traces must hold the same rows: rank 0 writes, the KDA norms of
all heads are gathered, top-k sets and routes are the replicated ones.
"""

from __future__ import annotations

import numpy as np
import pytest

import workbench
from tests.engine.test_parallel import _torchrun
from apps.cli import main

PROMPT = "Parallel ranks record once: the sparse reads, the recurrent memory and the routes."


@pytest.mark.parametrize("world", [2])
def test_trace_of_a_torchrun_job_equals_the_single_process_trace(checkpoint_dir, tmp_path, world):
    ckpt = checkpoint_dir("tiny-tp", "k3.1", seed=3)
    args = ["run", "--model", str(ckpt), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "4",
            "--prefill-chunk", "16", "--policy", "all"]
    assert main([*args, "--trace", str(tmp_path / "single")]) == 0
    job = _torchrun(world, *args, "--trace", str(tmp_path / "parallel"))
    assert job.returncode == 0, job.stderr
    single, parallel = workbench.open_trace(tmp_path / "single"), workbench.open_trace(tmp_path / "parallel")
    assert parallel.status == "complete" and parallel.session["engine"]["world_size"] == world
    for table, key in (("dsa_topk", ["layer", "position"]), ("moe_routes", ["layer", "position"]),
                       ("kda_norms", ["layer", "position"])):
        a = single.df(table).sort_values(key).reset_index(drop=True)
        b = parallel.df(table).sort_values(key).reset_index(drop=True)
        assert len(a) == len(b) > 0, table  # once per layer and position: no duplicate from rank 1
        assert (b["rank"] == 0).all()
        assert a[key].equals(b[key])
        if table == "dsa_topk":
            assert all(np.array_equal(x, y) for x, y in zip(a["selected"], b["selected"]))
        elif table == "moe_routes":
            assert all(set(x) == set(y) for x, y in zip(a["experts"], b["experts"]))
        else:  # every head's norm, gathered across the ranks that hold them
            na, nb = np.stack(a["norm"].to_list()), np.stack(b["norm"].to_list())
            assert na.shape == nb.shape and np.allclose(na, nb, rtol=2e-3, atol=1e-3)
    load = parallel.df("moe_rank_load")
    assert sorted(load["ep_rank"].unique()) == list(range(world))
    counts_a = single.df("dsa_key_counts").groupby("layer")["count"].sum()
    counts_b = parallel.df("dsa_key_counts").groupby("layer")["count"].sum()
    assert counts_a.equals(counts_b)
