"""`python -m launch.gpucheck`."""

from launch.gpucheck import main

main()
