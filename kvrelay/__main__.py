from kvrelay.cli import main

main()
