"""`python -m cachewarm` is the same CLI as the `cachewarm` console script."""

from cachewarm.cli.main import main

if __name__ == "__main__":
    main()
