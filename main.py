"""python main.py {fit,validate,test,predict,record,evaluate,convert} --config configs/...yaml"""

from lightning_wm.cli import main

if __name__ == "__main__":
    main()
