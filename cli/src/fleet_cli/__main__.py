from fleet_cli.main import main

main()
