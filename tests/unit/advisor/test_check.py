"""``parallelize check`` findings (advisor/check.py): each pitfall with its severity and words.
"""

import pytest

from parallelizer.advisor.check import check_spec
from parallelizer.advisor.cluster import cluster_from_dict
from parallelizer.frontend.spec import Spec

A100 = dict(nodes=4, gpus_per_node=8, gpu="a100-80gb", inter_node={"bandwidth_gb_s": 25, "latency_us": 5})


# --- check ----------------------------------------------------------------------------------

def _spec(**kw):
    return Spec.model_validate(kw)


@pytest.mark.parametrize("spec, kwargs, severity, words", [
    (dict(mesh=dict(tp=16, dp=2)), {}, "warning", ["mesh.tp", "tp = 16 spans 2 nodes", "25 GB/s", "tp <= 8"]),
    (dict(mesh=dict(pp=4, dp=8), pipeline=dict(microbatches=4)), {}, "warning",
     ["pipeline.microbatches", "bubble of (p-1)/(m+p-1) = 43%", ">= 8"]),
    (dict(mesh=dict(dp=32), zero_stage=3, fsdp=dict(prefetch=dict(forward=0))), {}, "warning",
     ["fsdp.prefetch", "forward = 0", "set it to 1"]),
    (dict(mesh=dict(dp=32)), dict(memory_bytes=90e9, memory_detail="states 80 GB"), "error",
     ["90.0 GB", "states 80 GB", "72.0 GB usable", "0.9 of 80.0 GB", "parallelize plan"]),
    (dict(mesh=dict(dp=16)), {}, "error", ["16 x 1 x 1 = 16", "4 x 8 = 32", "mesh.dp to 32"]),
    (dict(mesh=dict(dp=32)), dict(global_batch=100, micro_batch=2), "error",
     ["--global-batch 100", "32 x 1 x 2 = 64", "multiple of 64"]),
], ids=["tp-across-nodes", "few-microbatches", "zero3-no-prefetch", "memory", "world", "batch"])
def test_every_check_finding(spec, kwargs, severity, words):
    found = check_spec(_spec(**spec), cluster_from_dict(A100), **kwargs)
    assert len(found) == 1, found
    assert found[0].severity == severity
    for w in words:
        assert w in str(found[0]), (w, str(found[0]))


def test_a_good_spec_has_no_findings():
    spec = _spec(mesh=dict(tp=8, pp=2, dp=2), pipeline=dict(microbatches=8))
    assert check_spec(spec, cluster_from_dict(A100), 40e9, "", global_batch=64, micro_batch=4) == []
