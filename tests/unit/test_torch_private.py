"""One smoke test per private torch symbol behind `polytrain._torch_private` (STYLE 18).

A torch upgrade that moves, renames or changes one of them fails here, by name. The last test
keeps the door single: no other module imports a private torch module or reaches for a private
attribute that polytrain does not define itself.
"""

from __future__ import annotations

import ast
import datetime
import inspect
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.nn.parallel import DistributedDataParallel

from polytrain import _torch_private as private

PACKAGE = Path(private.__file__).resolve().parent


def test_replicate_is_a_composable_api() -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate  # what it wraps

    assert "mesh" in inspect.signature(replicate).parameters
    assert callable(private.replicate)


def test_queue_backward_callback_runs_after_the_whole_backward() -> None:
    order: list[str] = []
    w = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        private.queue_backward_callback(lambda: order.append("callback"))
        order.append("hook")
        return grad

    y = (w * 2).sum()
    w.register_hook(hook)
    y.backward()
    assert order == ["hook", "callback"]


def test_ddp_ignore_marks_the_parameters_ddp_skips() -> None:
    model = nn.Linear(2, 2)
    private.ddp_ignore(model, ["weight"])
    assert model._ddp_params_and_buffers_to_ignore == ["weight"]  # what DDP's __init__ reads
    assert hasattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")


def test_default_store_is_the_default_groups_store(tmp_path: Path) -> None:
    assert private.default_store() is None  # no process group yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        store = private.default_store()
        assert store is not None
        store.set("polytrain-smoke", "1")
        assert store.get("polytrain-smoke") == b"1"
    finally:
        dist.destroy_process_group()


def test_storage_key_tells_storages_apart_also_on_meta() -> None:
    a = torch.zeros(4)
    assert private.storage_key(a) == private.storage_key(a[1:])  # views share it
    assert private.storage_key(a) != private.storage_key(torch.zeros(4))
    m1, m2 = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert m1.untyped_storage().data_ptr() == m2.untyped_storage().data_ptr() == 0
    assert private.storage_key(m1) != private.storage_key(m2)


def test_strided_shard_gives_each_rank_its_piece_of_every_chunk() -> None:
    placement = private.strided_shard(0, 3)  # [q | k | v] of width 2 each, over 2 ranks
    pieces, _ = placement._split_tensor(torch.arange(6), 2, with_padding=False)
    assert [p.tolist() for p in pieces] == [[0, 2, 4], [1, 3, 5]]
    assert not placement.is_replicate()  # counted as sharded by grad_square_sum


def test_monitored_agent_hooks_the_agents_worker_check() -> None:
    hook = LocalElasticAgent.__dict__.get("_monitor_workers")
    assert callable(hook), "LocalElasticAgent._monitor_workers is gone: TolerantAgent is blind"
    assert "_pcontext" in LocalElasticAgent.__init__.__code__.co_names
    assert "_monitor_workers" in private.MonitoredAgent.__dict__


def test_rendezvous_handler_store_hooks_exist() -> None:
    store = dist.HashStore()
    params = RendezvousParameters(
        backend="c10d", endpoint="localhost:0", run_id="smoke", min_nodes=1, max_nodes=1
    )
    handler = create_handler(store, C10dRendezvousBackend(store, "smoke"), params)
    for name in ("_shared_tcp_store_server", "_bootstrap_store_info", "_create_tcp_store_server"):
        assert hasattr(handler, name), f"DynamicRendezvousHandler.{name} is gone"
    made: list[tuple[str, int]] = []

    def factory(addr: str, port: int) -> dist.TCPStore:
        made.append((addr, port))
        return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))

    private.set_store_server_factory(handler, factory)
    private.forget_shared_store(handler)
    assert handler._shared_tcp_store_server is None and handler._bootstrap_store_info is None
    handler._create_tcp_store_server("127.0.0.1", 1234)
    assert made == [("127.0.0.1", 1234)]


def _own_private_names(sources: list[Path]) -> set[str]:
    """Private names polytrain defines: functions, classes, variables, ``self._x`` attributes."""
    own: set[str] = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                own.add(node.value)  # object.__setattr__(layer, "_sf_exchange", ...)
    return own


def test_gloo_options_carry_a_timeout() -> None:
    options = private.gloo_options(datetime.timedelta(seconds=7))
    assert options._timeout == datetime.timedelta(seconds=7)  # what init_device_mesh reads
    assert len(options._devices) == 1  # ProcessGroupGloo refuses options without a device


def test_attention_ops_include_the_cpu_kernel() -> None:
    ops = private.attention_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ops
    assert len(ops) >= 3


def test_no_other_module_reaches_past_the_door() -> None:
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "_torch_private.py"]
    own = _own_private_names(sources) | {"_exit"}  # os._exit: public, documented stdlib
    offenders = []
    for path in sources:
        rel = path.relative_to(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                names = [a.name for a in node.names]
                if parts[0] == "torch" and any(x.startswith("_") for x in parts + names):
                    offenders.append(f"{rel}:{node.lineno} imports {node.module} {names}")
            elif isinstance(node, ast.Attribute):
                name = node.attr
                if name.startswith("_") and not name.startswith("__") and name not in own:
                    offenders.append(f"{rel}:{node.lineno} uses .{name}")
    assert not offenders, "private torch API outside _torch_private.py:\n" + "\n".join(offenders)


def test_torch_dispatch_mode_sees_forward_and_backward_operators() -> None:
    seen: list[str] = []

    class Names(private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, 3, device="meta", requires_grad=True)
    with Names():
        y = (x * 2).sum()
        y.backward()
    assert "aten.mul" in seen and "aten.sum" in seen and len(seen) > 3
