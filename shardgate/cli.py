"""Command-line entry point."""


def main() -> None:
    print("shardgate")
