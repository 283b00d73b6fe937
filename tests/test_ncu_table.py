"""scripts/ncu_kernels.py --table: ncu's CSV read back as metric x launch (CPU only)."""

import pytest
from conftest import load_script

ncu_kernels = load_script("ncu_kernels")

HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Metric Name","Metric Unit","Metric Value"\n'


def _csv(tmp_path, launches):
    """An ncu ``--csv`` file (the program's own lines first) with two metrics a launch."""
    lines = ["[flashmla] loaded x.so\n", "shape 16x9x4x16384: FlashMLA splits 47\n", HEADER]
    for i, name in enumerate(launches):
        for metric, value in (("gpu__time_duration.sum", f"{1000 + i:,}"), ("lts__t_sectors.sum", str(10 * i))):
            lines.append(f'"{i}","1","python3","h","{name}","1","7","{metric}","x","{value}"\n')
    path = tmp_path / "ncu.csv"
    path.write_text("".join(lines))
    return str(path)


def test_table_names_each_launch_by_shape_and_kernel(tmp_path):
    round_ = ["void sm90::flash_fwd_splitkv_mla_kernel<...>", "_hopper_verify_kernel", "_hopper_verify_kernel"]
    path = _csv(tmp_path, round_ * 4)  # two shapes, two rounds each
    lines = ncu_kernels.table(path, ["16x9x4x16384", "64x33x4x131072"])
    head = lines[0].split("\t")
    assert head[0] == "metric" and len(head) == 13
    assert head[1:4] == ["16x9x4x16384 flashmla", "16x9x4x16384 unfused", "16x9x4x16384 fused"]
    assert head[4:7] == head[1:4] and head[7] == "64x33x4x131072 flashmla" and head[12] == "64x33x4x131072 fused"
    assert lines[1].split("\t") == ["gpu__time_duration.sum"] + [str(1000 + i) for i in range(12)]  # "1,000" -> 1000
    assert lines[2].split("\t")[1:3] == ["0", "10"] and len(lines) == 3


def test_table_refuses_launches_that_do_not_divide_among_the_shapes(tmp_path):
    path = _csv(tmp_path, ["_hopper_verify_kernel"] * 5)
    with pytest.raises(ValueError, match="5 profiled launches do not divide among 2 shapes"):
        ncu_kernels.table(path, ["16x9x4x16384", "64x33x4x131072"])
