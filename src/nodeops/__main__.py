from nodeops.cli import main

main()
