"""`make bench`: the benchmarks, each measuring the project and its baseline in one run
on the local stack (bench/README.md says what each figure is and how to add a group)."""
