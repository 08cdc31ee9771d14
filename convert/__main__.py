from convert.cli import main

main()
