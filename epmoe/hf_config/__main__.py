from epmoe.hf_config.cli import main

raise SystemExit(main())
