#!/bin/sh
# The distillation claims of issue 3, on one data set and one step budget (cached teacher data).
# Usage: sh specd/claims.sh [STEPS]   -> out/claims/*/report.json and out/claims/table.txt
set -e
S=${1:-100}
B=.venv/bin/specd
O=out/claims
$B distill --kind eagle --objective fkl --steps $S --out $O/eagle-fkl
$B distill --kind eagle --objective ntp --steps $S --out $O/eagle-ntp
$B distill --kind eagle --objective fkl --steps $S --domain code --out $O/eagle-fkl-code
$B distill --kind truncated:4 --objective fkl --steps $S --out $O/truncated4-fkl
$B distill --kind truncated:4 --objective ntp --steps $S --out $O/truncated4-ntp
$B distill --kind small --objective fkl --steps $S --out $O/small-fkl
.venv/bin/python -c "from specd.distill import compare; import glob; print(compare(sorted(glob.glob('$O/*/'))))" | tee $O/table.txt
