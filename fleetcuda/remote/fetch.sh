# fetch URL DEST: downloads through apt's own fetcher (present wherever apt is), else curl or wget; local
# paths and file:// URLs are copied, so an offline fleet can stage the file.
fetch() {
  case "$1" in
    file://*) cp -- "${1#file://}" "$2" ;;
    /*) cp -- "$1" "$2" ;;
    *) if [ -x /usr/lib/apt/apt-helper ]; then /usr/lib/apt/apt-helper -q download-file "$1" "$2"
       elif command -v curl >/dev/null; then curl -fsSL --retry 2 -o "$2" "$1"
       elif command -v wget >/dev/null; then wget -q -O "$2" "$1"
       else echo "fleetcuda: no downloader (apt-helper, curl, wget) for $1" >&2; return 1; fi ;;
  esac
}
