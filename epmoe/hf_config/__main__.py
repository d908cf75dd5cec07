from epmoe.hf_config.cli import main
from epmoe.outputs import run_main

run_main(main)
