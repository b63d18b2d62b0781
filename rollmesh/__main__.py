from rollmesh.cli import main

raise SystemExit(main())
