"""The host and the models on it: facts read from /proc and the cgroup files (`host`), the prefix
cache's share of the memory free at start-up (`memory_budget`), loading the pair with its checks
(`loading`), and the CPU's kernels and the draft's int8 weights (`cpu_speed`)."""
