from adaserve.cli import main

raise SystemExit(main())
