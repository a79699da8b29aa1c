"""bench_kv_policy's summary of repeated runs."""
from benchmarks.bench_kv_policy import median_run


def test_median_run_is_the_middle_run_by_tok_s_with_every_run_beside_it():
    runs = [{"output_tok_s": t, "duration_s": 400 / t, "policy": i} for i, t in enumerate([50.0, 40.0, 80.0])]
    row = median_run(runs)
    assert row["policy"] == 0 and row["output_tok_s"] == 50.0
    assert row["runs_output_tok_s"] == [50.0, 40.0, 80.0] and row["runs_duration_s"] == [8.0, 10.0, 5.0]
    assert median_run(runs[:2])["output_tok_s"] == 40.0  # an even count: the lower middle
