"""`python -m selfspec.analyze`: kept for the documented command; the entry point is selfspec/cli/analyze.py."""

if __name__ == "__main__":
    from selfspec.cli.analyze import main

    main()
