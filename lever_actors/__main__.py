from lever_actors.cli import main

raise SystemExit(main())
