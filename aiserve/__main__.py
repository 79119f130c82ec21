from aiserve.cli import main

main()
