"""Hardware catalog and cluster specs (pure, milliseconds)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import tomllib

from polytrain.errors import PlanError
from polytrain.planner.catalog import device, device_key_of, device_names, link, link_names, price
from polytrain.planner.cluster import parse_cluster

REQUIRED_DEVICES = {"M40", "V100", "A100-40GB", "A100-80GB", "H100", "H200", "L4", "cpu"}
REQUIRED_LINKS = {
    "pcie3", "pcie4", "pcie5", "nvlink3", "nvlink4", "ib100", "ib200", "ib400",
    "eth10", "eth25", "eth100", "eth400", "loopback",
}  # fmt: skip


def test_catalog_has_the_issue_devices_and_links_each_with_a_source() -> None:
    assert REQUIRED_DEVICES <= set(device_names())
    assert REQUIRED_LINKS <= set(link_names())
    for name in ("devices.toml", "links.toml", "prices.toml"):
        text = resources.files("polytrain.planner").joinpath("catalog", name).read_text()
        for key, row in tomllib.loads(text).items():
            assert row.get("source"), f"{name}: {key} has no source"
            if name == "devices.toml":
                assert row.get("efficiency_source"), f"{key} has no efficiency_source"


def test_units_are_converted_from_datasheet_figures() -> None:
    h100 = device("H100")
    assert h100.flops("bf16") == pytest.approx(989.4e12)
    assert h100.memory == 80 * 2**30
    assert h100.mem_bw == pytest.approx(3.35e12)
    assert device("a100-80gb").key == "A100-80GB"  # case-insensitive
    assert device("M40").flops("bf16") == device("M40").flops("fp32")  # no fast bf16
    assert link("ib400").bandwidth == pytest.approx(50e9)
    assert link("nvlink4").latency == pytest.approx(3.4e-6)
    assert price("A100-40GB") == pytest.approx(32.7726 / 8, rel=1e-3)
    assert price("M40") is None


def test_cpu_entry_is_derived_from_this_host() -> None:
    cpu = device("cpu")
    assert cpu.peak_flops["fp32"] > 1e9
    assert cpu.memory > 0


def test_cluster_spec_forms() -> None:
    c = parse_cluster("4x8xH100:ib400")
    assert (c.hosts, c.per_host, c.size) == (4, 8, 32)
    assert c.intra.key == "nvlink4" and c.inter is not None and c.inter.key == "ib400"
    one = parse_cluster("8xL4")
    assert (one.hosts, one.per_host, one.intra.key) == (1, 8, "pcie4")
    assert parse_cluster("M40").intra.key == "pcie3"
    # tp inside a host, dp across hosts
    assert c.link_for(stride=1, size=8).key == "nvlink4"
    assert c.link_for(stride=8, size=4).key == "ib400"
    assert c.with_size(12).hosts == 2


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("4x8xH1000:ib400", "unknown device 'H1000'"),
        ("4x8xH100:ib999", "unknown link 'ib999'"),
        ("4x8xH100", "names no link between them"),
        ("4y8", "malformed cluster spec '4y8'"),
        ("0x8xH100:ib400", "must be >= 1"),
    ],
)
def test_bad_cluster_specs_name_the_bad_token(spec: str, needle: str) -> None:
    with pytest.raises(PlanError) as exc:
        parse_cluster(spec)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_cluster_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\nhosts = 2\ndevices_per_host = 4\ndevice = "A100-80GB"\n'
        'inter_link = "ib200"\nprice_per_device_hour = 1.5\n'
    )
    c = parse_cluster(str(path))
    assert (c.size, c.price_per_device_hour, c.intra.key) == (8, 1.5, "nvlink3")
    path.write_text('[cluster]\ndevice = "H100"\ncolour = "red"\n')
    with pytest.raises(PlanError, match="unknown key 'colour'"):
        parse_cluster(str(path))


def test_a_cluster_toml_overrides_the_catalogs_figures(tmp_path: Path) -> None:
    """[Note: cluster overrides]: memory, peak (per dtype, the rest kept), efficiency, memory
    bandwidth and each link's bandwidth and latency, in the catalog's units."""
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\nhosts = 2\ndevices_per_host = 8\ndevice = "H100"\ninter_link = "ib400"\n'
        "memory_gib = 96\nmem_bw_gbs = 2400\nefficiency = 0.4\npeak_tflops = { bf16 = 800 }\n"
        "intra_bandwidth_gbs = 300\ninter_latency_us = 20\n"
    )
    c = parse_cluster(str(path))
    catalog = parse_cluster("2x8xH100:ib400")
    assert c.device.memory == 96 * 2**30 and c.device.mem_bw == 2.4e12
    assert c.device.efficiency == 0.4
    assert c.device.flops("bf16") == 800e12
    assert c.device.flops("fp32") == catalog.device.flops("fp32")
    assert c.intra.bandwidth == 300e9 and c.intra.latency == catalog.intra.latency
    assert c.inter is not None and catalog.inter is not None
    assert c.inter.latency == pytest.approx(20e-6)
    assert c.inter.bandwidth == catalog.inter.bandwidth
    path.write_text('[cluster]\ndevice = "H100"\nmemory_gib = -1\n')
    with pytest.raises(PlanError, match="memory_gib = -1: expected a positive number"):
        parse_cluster(str(path))
    path.write_text('[cluster]\ndevice = "H100"\ninter_bandwidth_gbs = 50\n')
    with pytest.raises(PlanError, match="no inter_link"):
        parse_cluster(str(path))


def test_device_variants_by_memory_and_form() -> None:
    """The variants published runs used: V100 16 GB, P100 (SXM2 on NVLink 1, PCIe), H100 NVL 94
    GB and torchtitan's H100 96 GB, each found from torch's name for it."""
    assert device("V100-16GB").memory == 16 * 2**30
    assert device("V100-16GB").flops("fp16") == device("V100").flops("fp16")
    assert device("P100").intra_link == "nvlink1" and link("nvlink1").bandwidth == 80e9
    assert device("P100-PCIE").flops("fp32") == pytest.approx(9.3e12)
    assert device("H100-NVL").memory == 94 * 2**30
    assert device("H100-96GB").memory == 96 * 2**30
    names = {
        "Tesla V100-SXM2-16GB": "V100-16GB",
        "Tesla V100-SXM2-32GB": "V100",
        "Tesla P100-SXM2-16GB": "P100",
        "Tesla P100-PCIE-16GB": "P100-PCIE",
        "NVIDIA H100 NVL": "H100-NVL",
        "NVIDIA H100 80GB HBM3": "H100",
    }
    for name, key in names.items():
        assert device_key_of(name) == key, name
