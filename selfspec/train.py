"""`python -m selfspec.train`: kept for the documented command; the entry point is selfspec/cli/train.py."""

if __name__ == "__main__":
    from selfspec.cli.train import main

    main()
