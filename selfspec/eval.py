"""`python -m selfspec.eval`: kept for the documented command; the entry point is selfspec/cli/eval.py."""

if __name__ == "__main__":
    from selfspec.cli.eval import main

    main()
