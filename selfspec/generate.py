"""`python -m selfspec.generate`: kept for the documented command; the entry point is selfspec/cli/generate.py."""

if __name__ == "__main__":
    from selfspec.cli.generate import main

    main()
