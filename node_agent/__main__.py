import sys

from remp.cli import main

if __name__ == "__main__":
    sys.exit(main(["agent", *sys.argv[1:]]))
