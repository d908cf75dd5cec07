from epmoe.launch.cli import main
from epmoe.outputs import run_main

run_main(main)
