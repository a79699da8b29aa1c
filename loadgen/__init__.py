"""Load generator: trace replay (Azure LLM inference, BurstGPT) and synthetic workloads against any
OpenAI-compatible server, with vLLM `bench serve` metrics, goodput, reports and plots.

    traces.py    trace readers and filters          arrivals.py  rescaling, Poisson/gamma arrivals, lengths
    prompts.py   exact-length prompts (WikiText-2)  client.py    async streaming client, per-request record
    runner.py    open-loop dispatch, progress bar   metrics.py   summary with vLLM's definitions and keys
    report.py    table, summary.json, requests.csv  plots.py     latency CDFs, throughput/queue over time
    compare.py   runs side by side                  cli.py       `hetserve loadgen replay|synth|compare`
    fake_server.py  a fast fake endpoint for measuring the client itself
"""
