from .rank import main

main()
