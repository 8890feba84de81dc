"""Compare Megatron-LM checkpoints bitwise: model weights and optimizer state.

    python scripts/megatron/compare_checkpoints.py SAVE_DIR_A SAVE_DIR_B [SAVE_DIR_C ...]

Each SAVE_DIR is what ``--save`` wrote (its latest iteration is read from
latest_checkpointed_iteration.txt), in either format: ``torch_dist`` (a torch.distributed
checkpoint, read with torch's ``dcp_to_torch_save``) or ``torch`` (mp_rank_00/model_optim_rng.pt).
Every tensor is compared with torch.equal under its checkpoint key; keys under ``optimizer`` count
as optimizer state, keys under ``rng_state`` (torch_dist stores the RNG states as byte tensors) as
RNG state, the others as the model. Non-tensor entries (TE's extra state, the run's arguments) are
counted, not compared. Prints one line per checkpoint after the first and a verdict on the weights
and the optimizer state; exits 1 when one of those differs or the key sets differ. A differing RNG
state is reported beside the verdict, not in it: it is the generators' position, not a trained
value, and Megatron's resume path may draw from it between loading and saving.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _iteration_dir(save_dir: str) -> str:
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        tag = f.read().strip()
    return os.path.join(save_dir, tag if tag == "release" else f"iter_{int(tag):07d}")


def _flatten(obj, prefix: str, out: dict) -> dict:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}", out)
    else:
        out[prefix] = obj
    return out


def load_flat(save_dir: str) -> dict:
    """{key: tensor or other value} of a checkpoint's latest iteration (see the module doc)."""
    import torch

    folder = _iteration_dir(save_dir)
    legacy = os.path.join(folder, "mp_rank_00", "model_optim_rng.pt")
    if os.path.exists(legacy):
        state = torch.load(legacy, map_location="cpu", weights_only=False)
        return _flatten({"model": state.get("model"), "optimizer": state.get("optimizer")}, "", {})
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(folder, path)
        state = torch.load(path, map_location="cpu", weights_only=False)
    return _flatten(state, "", {})


def compare(reference: dict, other: dict) -> dict:
    """Counts of equal and differing tensors by kind ('model', 'optimizer'), and key differences."""
    import torch

    result = {"model": [0, []], "optimizer": [0, []], "rng state": [0, []],
              "only_in_one": sorted(set(reference) ^ set(other)), "not_tensors": 0}
    for key in sorted(set(reference) & set(other)):
        a, b = reference[key], other[key]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            result["not_tensors"] += 1
            continue
        kind = ("optimizer" if key.startswith("optimizer") else "rng state" if key.startswith("rng_state")
                else "model")
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if same:
            result[kind][0] += 1
        else:
            result[kind][1].append(key)
    return result


def same_files(a_dir: str, b_dir: str) -> tuple[int, list]:
    """(files compared, names that differ) of the tensor files (*.distcp) of two checkpoints' latest
    iterations, byte for byte: the fallback when torch cannot read the checkpoint as a state dict."""
    a, b = _iteration_dir(a_dir), _iteration_dir(b_dir)
    names = sorted(n for n in os.listdir(a) if n.endswith(".distcp"))
    differ = [n for n in names if not os.path.exists(os.path.join(b, n))
              or open(os.path.join(a, n), "rb").read() != open(os.path.join(b, n), "rb").read()]
    return len(names), differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save_dirs", nargs="+", help="the first is the reference")
    args = parser.parse_args(argv)
    if len(args.save_dirs) < 2:
        parser.error("give at least two checkpoints")
    try:
        reference = load_flat(args.save_dirs[0])
    except Exception as exc:  # noqa: BLE001  (any reader failure: fall back to the files' bytes)
        print(f"cannot read {args.save_dirs[0]} as a state dict ({type(exc).__name__}: {exc}); comparing the "
              "*.distcp files byte for byte instead (equal files: equal tensors; unequal: inconclusive)")
        ok = True
        for save_dir in args.save_dirs[1:]:
            count, differ = same_files(args.save_dirs[0], save_dir)
            print(f"checkpoint {save_dir} vs {args.save_dirs[0]}: {count} tensor files, {len(differ)} differ {differ}")
            ok = ok and count > 0 and not differ
        print("checkpoints: " + ("FILES BYTE-EQUAL" if ok else "FILES DIFFER (inconclusive)"))
        return 0 if ok else 1
    ok = True
    for save_dir in args.save_dirs[1:]:
        r = compare(reference, load_flat(save_dir))
        parts = []
        for kind in ("model", "optimizer", "rng state"):
            equal, differ = r[kind]
            if kind == "rng state" and not equal and not differ:
                continue
            parts.append(f"{kind}: {equal} tensors bitwise equal, {len(differ)} differ"
                         + (f" (e.g. {differ[:3]})" if differ else ""))
            if kind != "rng state":
                ok = ok and not differ and equal > 0
        if r["only_in_one"]:
            parts.append(f"keys in one only: {len(r['only_in_one'])} (e.g. {r['only_in_one'][:3]})")
            ok = False
        print(f"checkpoint {save_dir} vs {args.save_dirs[0]}: " + "; ".join(parts)
              + f"; {r['not_tensors']} non-tensor entries not compared", flush=True)
    print("checkpoints: " + ("BITWISE EQUAL (weights and optimizer state)" if ok else "DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
