from engramrt.cli import main

if __name__ == "__main__":  # spawned stage processes import this module too
    raise SystemExit(main())
