from checkpoints_convert.cli import main

main()
