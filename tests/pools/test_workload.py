"""`pools.workload`'s models: a workload file refused for a wrong type, an out-of-range value or an unknown
key with a `SpecError` naming the key path; the classes built in Python checked the same way."""

from __future__ import annotations

import pytest

from pools.config.checks import SpecError
from pools.workload import LengthDist, SharedPrefix, WorkloadClass, check_positive, load_workload, parse_workload


def _classes(*extra: dict) -> dict:
    """A valid first class, then the `extra` classes (each a valid class with the keys given changed)."""
    base = {"name": "a", "prompt_len": 8, "output_len": 4}
    return {"classes": [base] + [{**base, "name": f"c{i}", **e} for i, e in enumerate(extra, 1)]}


@pytest.mark.parametrize("extra, message", [
    ({"share": "high"}, r"^classes\[1\]\.share: expected a number, got string 'high'$"),
    ({"prompt_len": "long"}, r"^classes\[1\]\.prompt_len: must be a token count \(an integer >= 1\) or a "
                             r"distribution \(\{dist: \.\.\.\}\), got 'long' \(str\)$"),
    ({"prompt_len": {"dist": "uniform", "min": 2, "max": 8.5}},
     r"^classes\[1\]\.prompt_len\.max: expected an integer, got number 8\.5$"),
    ({"ignore_eos": 1}, r"^classes\[1\]\.ignore_eos: expected a boolean, got integer 1$"),
    ({"name": 3}, r"^classes\[1\]\.name: expected a string, got integer 3$"),
    ({"shared_prefix": 5}, r"^classes\[1\]\.shared_prefix: expected an object, got integer 5$"),
])
def test_a_wrong_type_names_the_key_path(extra, message):
    with pytest.raises(SpecError, match=message):
        parse_workload(_classes(extra))


@pytest.mark.parametrize("extra, message", [
    ({"prompt_len": {"dist": "normal", "mean": 0, "std": 2}}, r"^classes\[1\]\.prompt_len\.mean: must be > 0\.0, got 0$"),
    ({"prompt_len": {"dist": "normal", "mean": 9, "std": -1}}, r"^classes\[1\]\.prompt_len\.std: must be >= 0\.0, got -1$"),
    ({"output_len": 0}, r"^classes\[1\]\.output_len\.value: must be >= 1, got 0$"),
    ({"shared_prefix": {"tokens": 100, "count": 0}}, r"^classes\[1\]\.shared_prefix\.count: must be >= 1, got 0$"),
    ({"temperature": -0.5}, r"^classes\[1\]\.temperature: must be >= 0\.0, got -0\.5$"),
    ({"rate": float("inf")}, r"^classes\[1\]\.rate: must be a finite number, got inf$"),
    ({"prompt_len": {"dist": "uniform", "min": 9, "max": 3}}, r"^classes\[1\]\.prompt_len\.max: must be >= min 9, got 3$"),
    ({"name": "chat\n"}, r"^classes\[1\]\.name: must be letters, digits, '_', '\.' or '-' \(a label\), got 'chat\\n'$"),
])
def test_an_out_of_range_value_names_the_key_path(extra, message):
    with pytest.raises(SpecError, match=message):
        parse_workload(_classes(extra))


@pytest.mark.parametrize("data, message", [
    (_classes({"prompt_len": {"dist": "normal", "mean": 8, "std": 2, "stdev": 3}}),
     r"^classes\[1\]\.prompt_len\.stdev: unknown key \(value 3\); allowed keys: dist, value, min, max, mean, std$"),
    (_classes({"shared_prefix": {"tokens": 100, "docs": 3}}),
     r"^classes\[1\]\.shared_prefix\.docs: unknown key \(value 3\); allowed keys: tokens, count$"),
    (_classes({"colour": "red"}), r"^classes\[1\]\.colour: unknown key \(value 'red'\); allowed keys: name, prompt_len, "),
    ({**_classes(), "clases": []}, r"^clases: unknown key \(value \[\]\); allowed keys: classes, description$"),
])
def test_an_unknown_key_is_refused_by_name(data, message):
    with pytest.raises(SpecError, match=message):
        parse_workload(data)


def test_file_errors_end_with_the_path(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("classes: [{name: a, prompt_len: 8, output_len: 4}, {name: b, prompt_len: 8, output_len: 4,"
                    " shared_prefix: {tokens: 0}}]\n")
    with pytest.raises(SpecError, match=rf"^classes\[1\]\.shared_prefix\.tokens: must be >= 1, got 0 \(in {path}\)$"):
        load_workload(path)
    path.write_text("")
    with pytest.raises(SpecError, match=r"^classes: the workload file is empty"):
        load_workload(path)


def test_a_file_reads_into_the_classes():
    (plain, other) = parse_workload(_classes({
        "endpoint": "completion", "rate": 2, "ignore_eos": False, "temperature": 0,
        "prompt_len": {"dist": "normal", "mean": 64, "std": 8, "min": 16},
        "output_len": {"dist": "uniform", "min": 4, "max": 9}, "shared_prefix": {"tokens": 500, "count": 3}}))
    assert plain == WorkloadClass("a", prompt_len=LengthDist("fixed", value=8), output_len=LengthDist("fixed", value=4))
    assert other == WorkloadClass("c1", endpoint="completion", rate=2.0, ignore_eos=False, temperature=0.0,
                                  prompt_len=LengthDist("normal", mean=64.0, std=8.0, min=16),
                                  output_len=LengthDist("uniform", min=4, max=9),
                                  shared_prefix=SharedPrefix(tokens=500, count=3))
    assert other.weight == 0.0 and plain.weight == 1.0


@pytest.mark.parametrize("build, message", [
    (lambda f: LengthDist("fixed", value=0), r"^value: must be >= 1, got 0$"),
    (lambda f: LengthDist("gauss", value=3), r"^dist: must be one of fixed, normal, uniform, got 'gauss'$"),
    (lambda f: LengthDist("normal", mean=5), r"^std: required by dist normal$"),
    (lambda f: SharedPrefix(tokens=5, count=2.0), r"^count: expected an integer, got number 2\.0$"),
    (lambda f: WorkloadClass("a", prompt_len=8, output_len=f), r"^prompt_len: expected an object, got integer 8$"),
    (lambda f: WorkloadClass("a", prompt_len=f, output_len=f, shared_prefix=(3, 1)),
     r"^shared_prefix: expected an object, got array \(3, 1\)$"),
    (lambda f: WorkloadClass("a", prompt_len=f, output_len=f, share=1, rate=1), r"^rate: give share or rate, not both"),
    (lambda f: WorkloadClass("a", prompt_len=f, output_len=f).replace(endpoint="embeddings"),
     r"^endpoint: must be one of chat, completion, got 'embeddings'$"),
])
def test_classes_built_in_python_are_checked_by_the_same_models(build, message):
    with pytest.raises(SpecError, match=message):
        build(LengthDist("fixed", value=4))


def test_check_positive():
    check_positive("rate", None, optional=True)
    check_positive("rate", float("inf"), allow_inf=True)
    check_positive("probe_rate", 0, zero=True)
    for value, message in ((0, r"^rate: must be > 0\.0, got 0$"), (None, r"^rate: expected a number, got null$"),
                           (float("nan"), r"^rate: must be a finite number, got nan$"),
                           (True, r"^rate: expected a number, got boolean True$")):
        with pytest.raises(SpecError, match=message):
            check_positive("rate", value)


def test_a_burstiness_whose_gaps_are_zero_is_refused_and_a_bursty_draw_stays_bounded():
    """A gamma shape of 1e-9 draws gaps of 0: the generator looped for ever on a 2 s run."""
    import numpy as np

    from pools.workload import gamma_arrivals

    with pytest.raises(ValueError, match=r"burstiness: 1e-09 is below 0.01"):
        gamma_arrivals(2.0, 1e-9, np.random.default_rng(0), duration=2.0)
    assert len(gamma_arrivals(2.0, 0.01, np.random.default_rng(0), duration=60.0)) < 10_000


def test_arrivals_above_the_cap_are_refused_before_any_is_drawn():
    """1e12 requests/s for a minute once asked numpy for 7e13 floats (a MemoryError); 1e6 for ever."""
    import numpy as np

    from pools.workload import MAX_ARRIVALS, check_arrivals, class_arrivals, gamma_arrivals

    rng = np.random.default_rng(0)
    for kwargs in ({"duration": 60.0}, {"count": MAX_ARRIVALS + 1}, {"duration": 60.0, "count": 10**9}):
        with pytest.raises(ValueError, match=r"above the 10,000,000 one run may generate"):
            gamma_arrivals(1e12, 1.0, rng, **kwargs)
    assert len(gamma_arrivals(1e12, 1.0, rng, duration=60.0, count=5)) == 5      # the count bounds it
    chat = WorkloadClass("chat", prompt_len=LengthDist("fixed", value=4), output_len=LengthDist("fixed", value=4))
    with pytest.raises(ValueError, match=r"above the 10,000,000"):
        class_arrivals((chat,), 1e6, duration=60.0)
    check_arrivals((chat,), 1e5, 100.0)                                            # 10 million exactly: allowed
    with pytest.raises(ValueError, match=r"^--request-rate 1e\+06 x --duration 60: 1e\+06 requests/s for 60 s is "
                                         r"6e\+07 requests, above the 10,000,000 one run may generate; lower "
                                         r"--request-rate or --duration$"):
        check_arrivals((chat,), 1e6, 60.0)
    flood = chat.replace(name="flood", rate=1e9)
    with pytest.raises(ValueError, match=r"lower --sweep-rate, --duration or the workload's class rates$"):
        check_arrivals((chat, flood), 1.0, 60.0, "--sweep-rate")
