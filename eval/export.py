"""Write a trained drafter in an engine's draft-model format (the same as `specdecode export`):

python eval/export.py drafter=outputs/demo/distill-code/drafter format=sglang-eagle output=outputs/eagle-code
"""

import sys

from specdecode.pipeline.cli import export

if __name__ == "__main__":
    export(sys.argv[1:])
