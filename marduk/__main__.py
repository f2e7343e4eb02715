from marduk.cli import main

main()
