"""The workers' command line for several runs in one process: `COMMON -- RUN -- RUN ...`."""


def split_runs(args) -> list[list[str]]:
    """[common overrides, the first run's, the second's, ...]: the arguments split at each `--`."""
    groups = [[]]
    for arg in args:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    return groups
