"""distributed/comm.py's WeakGroup: the layer's objects hold their process group weakly, so a model
kept to the end of a script keeps no destroyed group alive (gloo aborts the process at interpreter
exit when one is: the README's torchrun example did so in about one run in eight)."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from moe_dispatch.distributed.comm import WeakGroup

ROOT = Path(__file__).resolve().parents[2]


def test_weak_group_gives_the_group_while_it_lives():
    class Group:  # any object that takes a weak reference stands for a ProcessGroup
        pass

    assert WeakGroup(None)() is None
    assert WeakGroup(-100)() == -100  # the int new_group returns to a rank outside the group
    group = Group()
    held = WeakGroup(group)
    assert held() is group
    del group
    gc.collect()
    with pytest.raises(ValueError, match="ep_group is not a live process group"):
        held()


KEPT_MODEL = """
import gc, weakref
import torch, torch.distributed as dist
from moe_dispatch import MoEConfig, MoELayer

dist.init_process_group("gloo")
layer = MoELayer(MoEConfig(hidden_size=32, num_experts=4, topk=2, ffn_hidden_size=32), layer_index=0)
x = torch.randn(6, 32, requires_grad=True)
layer(x).sum().backward()  # EP 2: the experts are sharded over the default group
state = layer.state_dict()  # DTensor shards on a DeviceMesh of the group, which holds the group
assert type(state["experts.weight1"]).__name__ == "DTensor"
del state
world = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
assert world() is None, "the model keeps the destroyed default group alive"
try:
    layer(x)
    raise AssertionError("the layer ran on a destroyed group")
except ValueError as exc:
    assert "ep_group is not a live process group" in str(exc), exc
"""


def test_a_model_kept_to_the_end_keeps_no_destroyed_group(tmp_path):
    script = tmp_path / "kept_model.py"
    script.write_text(KEPT_MODEL)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
