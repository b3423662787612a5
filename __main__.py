from normspec.conformance.cli import main

raise SystemExit(main())
