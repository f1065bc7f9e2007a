"""ZeRO strategies (work in progress)."""


def register(registry) -> None:  # placeholder until the strategy lands
    return None
