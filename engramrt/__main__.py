from engramrt.cli import main

raise SystemExit(main())
