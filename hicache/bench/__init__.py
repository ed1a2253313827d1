"""Hit-rate benchmark: workloads and traces, replay against a cache, the offline-optimal bound, a report,
and a prompt-structure doctor.

Pieces, one concern each:

* :mod:`~hicache.bench.workloads` -- the three workloads (multi-query RAG, few-shot classification,
  multi-turn chat) and a mix, deterministic by seed.
* :mod:`~hicache.bench.traces` -- own JSONL traces (token ids or text) and Mooncake's hash_ids format.
* :mod:`~hicache.bench.targets` -- what a trace is replayed against: the in-process cache, a node over gRPC,
  or a router in front of nodes.
* :mod:`~hicache.bench.replay` -- the replay loop (optionally following timestamps), per-tier accounting.
* :mod:`~hicache.bench.optimal` -- Belady's offline optimum on the prefix tree and the infinite bound.
* :mod:`~hicache.bench.report` / :mod:`~hicache.bench.plot` -- terminal table, JSON/CSV, PNG.
* :mod:`~hicache.bench.doctor` -- where misses diverge, what the diverging spans are, what fixing them buys.
* :mod:`~hicache.bench.run` -- one run: requests, replay, bounds, the capacity curve, as a typed result;
  :mod:`~hicache.bench.policy_table` -- LRU, the default policy and the optimum side by side;
  :mod:`~hicache.bench.sizing` -- the L2 that would bring a run within reach of its bound.
* :mod:`~hicache.bench.units` / :mod:`~hicache.bench.tokenizer` / :mod:`~hicache.bench.prefill` -- sizes as
  typed on the command line, tokenizers for text, a measured prefill rate.
* :mod:`~hicache.bench.cli` / :mod:`~hicache.bench.doctor_cli` -- ``hicache bench`` / ``hicache doctor``;
  :mod:`~hicache.bench.errors` -- the bad-input error they turn into exit code 2.
"""
