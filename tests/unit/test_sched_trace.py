"""The trace reader: both schemas, bad rows named by file and line, duplicates, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.trace import fit_cluster, offered_load, read_trace, sample


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_philly_columns_and_dates_read_as_utc(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"
        "2017-10-09 06:13:03,2951.0,8,23608.0,6214e9\n",
    )
    first, second = read_trace(path)
    assert (first.id, first.submitted, first.devices, first.model) == ("line-3", 0.0, 8, "medium")
    assert (second.id, second.submitted, second.duration) == ("line-2", 2932.0, 66.0)
    assert second.model == "small"  # 66 GPU-seconds


def test_our_schema_with_ids_min_devices_and_models(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "id,submitted,duration,devices,min_devices,model\na,10,100,4,2,xlarge\nb,40,5,1,,\n",
    )
    a, b = read_trace(path)
    assert (a.id, a.submitted, a.devices, a.min_devices, a.model) == ("a", 0.0, 4, 2, "xlarge")
    assert (b.submitted, b.min_devices, b.model) == (30.0, 1, "small")


@pytest.mark.parametrize(
    ("row", "named"),
    [
        ("x,yesterday,100,1", "submit time 'yesterday'"),
        ("x,0,abc,1", "duration 'abc'"),
        ("x,0,-5,1", "duration '-5'"),
        ("x,0,100,0", "devices '0'"),
        ("x,0,100,two", "devices 'two'"),
        ("x,0,100", "give one value per column"),
        ("x,0,100,1,5", "give one value per column"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path: Path, row: str, named: str) -> None:
    path = write(tmp_path, f"id,submitted,duration,devices\nok,0,10,1\n{row}\n")
    with pytest.raises(ConfigError) as exc:
        read_trace(path)
    message = str(exc.value)
    assert message.startswith(f"{path}:3: ") and named in message and "\n" not in message


def test_min_devices_above_devices_and_unknown_model_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r":2: min_devices 4: give at most the job's devices \(2\)"
    ):
        read_trace(write(tmp_path, "submitted,duration,devices,min_devices\n0,10,2,4\n"))
    with pytest.raises(ConfigError, match=r":2: model 'gpt5': give one of small, medium"):
        read_trace(write(tmp_path, "submitted,duration,devices,model\n0,10,2,gpt5\n"))


def test_a_duplicate_job_id_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "id,submitted,duration,devices\na,0,10,1\nb,1,10,1\na,2,10,1\n")
    with pytest.raises(
        ConfigError, match=r":4: job id 'a' repeats line 2: give every job its own id"
    ):
        read_trace(path)


def test_missing_columns_and_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no 'devices' or 'num_gpus' column"):
        read_trace(write(tmp_path, "submitted,duration\n0,10\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_trace(tmp_path / "nope.csv")


def test_sample_is_seeded_and_rebased(tmp_path: Path) -> None:
    rows = "".join(f"j{i},{100 * i},10,1\n" for i in range(50))
    jobs = read_trace(write(tmp_path, "id,submitted,duration,devices\n" + rows))
    one, again, other = sample(jobs, 10, 7), sample(jobs, 10, 7), sample(jobs, 10, 8)
    assert [j.id for j in one] == [j.id for j in again] != [j.id for j in other]
    assert one[0].submitted == 0.0 and [j.submitted for j in one] == sorted(
        j.submitted for j in one
    )
    with pytest.raises(ConfigError, match=r"--sample 51: give 1..50"):
        sample(jobs, 51, 0)


def test_a_job_larger_than_the_cluster_is_refused_or_dropped_when_asked(tmp_path: Path) -> None:
    jobs = read_trace(write(tmp_path, "id,submitted,duration,devices\na,0,10,2\nbig,5,10,16\n"))
    with pytest.raises(
        ConfigError, match=r"job 'big' \(line 3\) asks 16 devices, the cluster has 8"
    ):
        fit_cluster(jobs, 8)
    kept, dropped = fit_cluster(jobs, 8, drop=True)
    assert ([j.id for j in kept], dropped) == (["a"], 1)


def test_offered_load_is_work_over_capacity_of_the_arrival_span(tmp_path: Path) -> None:
    jobs = read_trace(write(tmp_path, "submitted,duration,devices\n0,100,2\n100,50,4\n"))
    assert offered_load(jobs, 4) == pytest.approx((200 + 200) / (4 * 100))
