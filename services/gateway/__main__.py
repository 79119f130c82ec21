from services.gateway.server import main

main()
